"""Our plugin at tensor_parallel_size=2 through real vLLM (CPU build, one core per rank).

The embedded default (a trained target and its trained b16 drafter, both shardable in two)
serves the held-out prompts greedily: at TP=2 with our proposer, at TP=2 without
speculation (the ground truth: TP=2 sums partial results in another order than TP=1, so
its greedy output is the one ours must equal), and at TP=1 with our proposer (the
acceptance length TP=2 must match). A probe loaded into every engine process
(tests/fixtures/tp_probe) records, per rank and per drafting step, what the drafter was
given and which all-gathers its logits took; a few sampled requests after the greedy ones
show what sampled drafts gather. The sampling law at TP=2 is checked in
test_serving_sampling.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from serving_harness import mean_acceptance_length, run_engine

from vllm_dflash import assets
from vllm_dflash.bench.compare_backends import cpu_binding
from vllm_dflash.bench.run import load_prompts
from vllm_dflash.config import DrafterConfig

# One worker runs the whole module, so each of its three engines starts once.
pytestmark = [pytest.mark.engine, pytest.mark.xdist_group("serving_tp")]
K = 15
MAX_NEW = 48
NUM_PROMPTS = 24
PROBE = Path(__file__).parent / "fixtures" / "tp_probe"
# vLLM's CPU build refuses TP=2 on one NUMA node unless each rank gets its own cores.
TP2 = {"tensor_parallel_size": 2}
TP2_ENV = {"VLLM_CPU_OMP_THREADS_BIND": cpu_binding(2)}


@pytest.fixture(scope="module")
def prompts():
    return load_prompts(assets.HELDOUT_PROMPTS, assets.TARGET, NUM_PROMPTS)


def _serve(tmp: Path, prompts, spec: bool, engine: dict, env: dict, sampled: bool = False):
    jobs = [{"name": "greedy", "prompts": prompts, "max_tokens": MAX_NEW, "concurrency": 4}]
    if sampled:  # drafts sampled from the drafter's whole distribution, split over 2 ranks
        sampled_job = {"name": "sampled", "prompts": prompts[:8], "max_tokens": 24}
        jobs.append(sampled_job | {"temperature": 1.0, "seed": 0, "concurrency": 4})
    config = {"method": "dflash", "model": str(assets.DRAFTER), "num_speculative_tokens": K}
    return run_engine(tmp, assets.TARGET, jobs, config if spec else None, engine, env=env)


@pytest.fixture(scope="module")
def ours_tp2(prompts, tmp_path_factory):
    probe_dir = tmp_path_factory.mktemp("probe")
    env = TP2_ENV | {"PYTHONPATH": str(PROBE), "VLLM_DFLASH_TP_PROBE": str(probe_dir)}
    jobs, log = _serve(tmp_path_factory.mktemp("ours-tp2"), prompts, True, TP2, env, True)
    ranks = [
        [json.loads(line) for line in path.read_text().splitlines()]
        for path in probe_dir.glob("*.jsonl")
    ]
    return jobs | {"log": log, "probe": sorted(ranks, key=lambda r: r[0]["rank"])}


@pytest.fixture(scope="module")
def plain_tp2(prompts, tmp_path_factory):
    return _serve(tmp_path_factory.mktemp("plain-tp2"), prompts, False, TP2, TP2_ENV)[0]


@pytest.fixture(scope="module")
def ours_tp1(prompts, tmp_path_factory):
    return _serve(tmp_path_factory.mktemp("ours-tp1"), prompts, True, {}, {})[0]


def _tokens(job) -> list[list[int]]:
    return [r["tokens"] for r in job["results"]]


def test_greedy_identical_to_tp2_without_speculation(ours_tp2, plain_tp2, prompts):
    assert len(prompts) >= 16
    assert _tokens(ours_tp2["greedy"]) == _tokens(plain_tp2["greedy"])
    assert ours_tp2["greedy"]["spec"]["accepted"] > 0
    assert "drafting from target layers" in ours_tp2["log"]
    assert "Worker_TP1" in ours_tp2["log"]  # two ranks ran


def test_acceptance_length_equals_tp1(ours_tp2, ours_tp1):
    tau2 = mean_acceptance_length(ours_tp2["greedy"]["spec"])
    tau1 = mean_acceptance_length(ours_tp1["greedy"]["spec"])
    pairs = zip(_tokens(ours_tp1["greedy"]), _tokens(ours_tp2["greedy"]), strict=True)
    same = sum(a == b for a, b in pairs)
    print(f"acceptance length: TP=1 {tau1:.4f}, TP=2 {tau2:.4f}; {same} outputs equal")
    assert tau1 > 3.0, "the embedded drafter should be accepted often"
    assert tau2 == pytest.approx(tau1, rel=0.02)


def test_every_rank_drafts_from_the_full_residual_stream(ours_tp2):
    """Both ranks see the same, full-width target features at every step: the hidden states
    of the drafter's five target layers, not one rank's slice of them. Greedy and sampled
    drafts alike agree across ranks."""
    ranks = ours_tp2["probe"]
    assert [r[0]["rank"] for r in ranks] == [0, 1] and all(r[0]["world"] == 2 for r in ranks)
    width = DrafterConfig.from_file(assets.DRAFTER / "config.json").feature_size
    rank0, rank1 = ranks
    assert len(rank0) == len(rank1) > 0
    for a, b in zip(rank0, rank1, strict=True):
        assert a["features"] == b["features"] and a["features"][1] == width
        assert a["checksum"] == pytest.approx(b["checksum"], rel=1e-6)
        assert a["drafts"] == b["drafts"]


def test_greedy_drafts_gather_pairs_not_the_vocabulary(ours_tp2):
    """The drafter's LM head stays vocabulary-parallel: for greedy drafts each rank sends
    one (max, id) pair per draft position, never its slice of the logits; sampled drafts
    gather the slices, as the rejection sampler needs the whole distribution."""
    vocab = json.loads((assets.TARGET / "config.json").read_text())["vocab_size"]
    assert vocab % 128 == 0  # no padding: each rank holds vocab / 2 real entries
    greedy, sampled = 0, 0
    for rank in ours_tp2["probe"]:
        for step in rank:
            n_positions = sum(map(len, step["drafts"]))
            width = 2 if step["all_greedy"] else vocab // 2
            assert step["gathers"] == [[n_positions, width]], step
            greedy += step["all_greedy"]
            sampled += not step["all_greedy"]
    assert greedy > 0 and sampled > 0
