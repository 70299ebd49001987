"""Our plugin serving greedy requests through real vLLM (CPU build), one engine for all jobs.

Every output is compared token for token with the same engine without speculation
(``plain``), and acceptance with the reference engine and with vLLM's built-in dflash on the
same checkpoint. Our engine has a deliberately small KV cache (24 blocks of 32) so that the
64-request job is forced to preempt, and a small step budget so that long prompts are
prefilled in chunks.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from serving_harness import distilled_drafter, mean_acceptance_length, random_prompts, run_engine

from vllm_dflash.reference.drafter import ReferenceDrafter
from vllm_dflash.reference.generate import spec_generate, target_generate

pytestmark = [pytest.mark.engine, pytest.mark.xdist_group("serving_greedy")]
MAX_NEW = 37
K = 7
CHUNK = 128
PROBES = Path(__file__).parent / "fixtures"


PARITY = random_prompts(1234, 32, 1, 40)
LONG = random_prompts(7, 4, 100, 300)  # 4..10 KV blocks each
SHARED = random_prompts(11, 1, 64, 64)[0]  # two full KV blocks, cached after the first request
PREFIX = [SHARED + p for p in random_prompts(12, 6, 1, 20)]
ABORTED = [1, 4, 6]
MIXED = random_prompts(99, 64, 1, 200)
MIXED_MAX = [random.Random(i).randint(5, 60) for i in range(64)]
STOP_MAX = [1, 2, 3, 5, 6, 7, 8, 9]  # inside the first or second draft block


@pytest.fixture(scope="module")
def tokenizer(target_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(target_dir)


@pytest.fixture(scope="module")
def stops(greedy, tokenizer):
    """Per prompt: a stop string taken from the target's own output a few tokens in, and
    the text vLLM must return (everything before its first occurrence)."""
    cases = []
    for i, p in enumerate(PARITY[8:16]):
        text = tokenizer.decode(greedy(p, MAX_NEW), skip_special_tokens=True)
        stop = text[2 + i % 6]
        cases.append((stop, text[: text.find(stop)]))
    return cases


@pytest.fixture(scope="module")
def drafter_dir(target, drafter_dirs, tmp_path_factory):
    """The block-8 drafter trained on the parity prompts by the training pipeline, so that
    it is often accepted: a drafter that is never right would give acceptance ~1 even if
    fed the wrong context. Its export is what both our plugin and vLLM's built-in load."""
    return distilled_drafter(
        target, drafter_dirs[8], tmp_path_factory.mktemp("distilled") / "b8", PARITY
    )


@pytest.fixture(scope="module")
def served(target_dir, drafter_dir, stops, tmp_path_factory):
    spec = {"method": "dflash", "model": str(drafter_dir), "num_speculative_tokens": K}
    jobs = [
        {"name": "c1", "prompts": PARITY, "max_tokens": MAX_NEW, "concurrency": 1},
        {"name": "c8", "prompts": PARITY, "max_tokens": MAX_NEW, "concurrency": 8},
        {"name": "long", "prompts": LONG, "max_tokens": 24},
        {"name": "prefix_cold", "prompts": PREFIX[:1], "max_tokens": 20},
        {"name": "prefix_warm", "prompts": PREFIX[1:], "max_tokens": 20},
        {"name": "max_tokens", "prompts": PARITY[:8], "max_tokens": STOP_MAX},
        *[
            {"name": f"stop{i}", "prompts": [p], "max_tokens": MAX_NEW, "stop": [stop]}
            for i, (p, (stop, _)) in enumerate(zip(PARITY[8:16], stops, strict=True))
        ],
        {
            "name": "abort",
            "prompts": PARITY[:8],
            "max_tokens": MAX_NEW,
            "abort": ABORTED,
            "abort_after_steps": 4,
        },
        {"name": "mixed64", "prompts": MIXED, "max_tokens": MIXED_MAX},
    ]
    engine = {
        "block_size": 32,
        "num_gpu_blocks_override": 24,
        "enable_prefix_caching": True,
        # A 128-token step budget: the 100-300-token prompts are prefilled in chunks, and
        # chunks share steps with other requests' decodes.
        "max_num_batched_tokens": CHUNK,
        "max_num_seqs": 64,
    }
    tmp = tmp_path_factory.mktemp("ours")
    # No baseline steps (observability/baseline.py): they drop every request's drafts for a
    # step at a time that depends on how requests batch, which moves acceptance by ~1 % from
    # run to run; the built-in, which our plugin leaves alone, takes none either.
    env = {"VLLM_DFLASH_BASELINE_EVERY": "0"}
    return run_engine(tmp, target_dir, jobs, spec, engine=engine, env=env)


@pytest.fixture(scope="module")
def masked_rows(target_dir, drafter_dir, tmp_path_factory):
    """Our engine again, on the proposer's GPU path (tests/fixtures/device_path_probe):
    rejected rows are masked to slot -1 instead of selected out (no device sync there)."""
    spec = {"method": "dflash", "model": str(drafter_dir), "num_speculative_tokens": K}
    jobs = [
        {"name": "c8", "prompts": PARITY, "max_tokens": MAX_NEW, "concurrency": 8},
        {"name": "mixed64", "prompts": MIXED, "max_tokens": MIXED_MAX},
    ]
    engine = {"block_size": 32, "num_gpu_blocks_override": 24, "max_num_seqs": 64}
    env = {"PYTHONPATH": str(PROBES / "device_path_probe"), "VLLM_DFLASH_BASELINE_EVERY": "0"}
    return run_engine(tmp_path_factory.mktemp("masked"), target_dir, jobs, spec, engine, env=env)


@pytest.fixture(scope="module")
def plain(target_dir, tmp_path_factory):
    """The same engine settings without speculation: the ground truth for greedy output."""
    jobs = [
        {"name": "c8", "prompts": PARITY, "max_tokens": MAX_NEW, "concurrency": 8},
        {"name": "long", "prompts": LONG, "max_tokens": 24},
        {"name": "prefix", "prompts": PREFIX, "max_tokens": 20},
        {"name": "max_tokens", "prompts": PARITY[:8], "max_tokens": STOP_MAX},
        {"name": "mixed64", "prompts": MIXED, "max_tokens": MIXED_MAX},
    ]
    engine = {"block_size": 32, "enable_prefix_caching": True}
    jobs, _ = run_engine(tmp_path_factory.mktemp("plain"), target_dir, jobs, engine=engine)
    return {name: _tokens(job) for name, job in jobs.items()}


@pytest.fixture(scope="module")
def builtin(target_dir, drafter_dir, tmp_path_factory):
    spec = {"method": "dflash", "model": str(drafter_dir), "num_speculative_tokens": K}
    jobs = [
        {"name": "c1", "prompts": PARITY, "max_tokens": MAX_NEW, "concurrency": 1},
        {"name": "c8", "prompts": PARITY, "max_tokens": MAX_NEW, "concurrency": 8},
    ]
    return run_engine(tmp_path_factory.mktemp("builtin"), target_dir, jobs, spec, backend="builtin")


@pytest.fixture(scope="module")
def greedy(target):
    cache: dict[tuple[int, ...], list[int]] = {}

    def ref(prompt: list[int], n: int) -> list[int]:
        key = (*prompt, -n)
        if key not in cache:
            cache[key] = target_generate(target, prompt, n).tokens
        return cache[key]

    return ref


def _tokens(job):
    return [r["tokens"] for r in job["results"]]


def test_log_says_ours_serves(served):
    _, log = served
    assert "vllm-dflash serves method 'dflash'" in log
    assert "drafting from target layers" in log
    # The compiled ops served these greedy-lossless runs (csrc/, built by `make install`).
    assert "vllm-dflash: custom ops loaded (CPU)" in log
    assert "context K/V through the fused inject_context_kv op (cpu" in log


@pytest.mark.parametrize("job", ["c1", "c8"])
def test_greedy_identical_to_no_speculation(served, plain, greedy, job):
    jobs, _ = served
    assert _tokens(jobs[job]) == plain["c8"]
    # and both equal the HF target, so the reference below is a valid oracle
    assert plain["c8"] == [greedy(p, MAX_NEW) for p in PARITY]


def test_acceptance_equals_reference_and_builtin(served, builtin, target, drafter_dir):
    ours, _ = served
    theirs, log = builtin
    assert "vllm-dflash stands aside: VLLM_DFLASH_BACKEND=builtin; vLLM is left as it is." in log
    drafter = ReferenceDrafter.load(drafter_dir, target)
    ref = [spec_generate(target, drafter, p, MAX_NEW) for p in PARITY]
    ref_tau = sum(sum(m + 1 for m in r.accepted) for r in ref) / sum(r.num_steps for r in ref)
    assert ref_tau > 1.8, "the distilled drafter should be accepted often"
    for job in ("c1", "c8"):
        tau = mean_acceptance_length(ours[job]["spec"])
        print(
            f"{job}: ours {tau:.4f}, built-in "  # see with -s
            f"{mean_acceptance_length(theirs[job]['spec']):.4f}, reference {ref_tau:.4f}"
        )
        assert tau == pytest.approx(ref_tau, rel=0.02), (job, tau, ref_tau)
        assert tau == pytest.approx(mean_acceptance_length(theirs[job]["spec"]), rel=0.02)
        assert _tokens(theirs[job]) == _tokens(ours[job])


def test_long_prompts_chunked_and_crossing_kv_blocks(served, plain):
    jobs, _ = served
    assert max(map(len, LONG)) > CHUNK  # prefilled in at least two chunks
    assert _tokens(jobs["long"]) == plain["long"]


def test_prefix_cache_hits_keep_outputs(served, plain):
    jobs, _ = served
    # vLLM recomputes the last matched block when a drafter needs target hidden states
    # (it keeps the drafter's context complete), so each warm request hits one of two blocks.
    assert jobs["prefix_warm"]["spec"]["prefix_hits"] >= 32 * len(PREFIX[1:])
    assert _tokens(jobs["prefix_cold"]) + _tokens(jobs["prefix_warm"]) == plain["prefix"]


def test_max_tokens_inside_a_draft_block(served, plain):
    jobs, _ = served
    results = jobs["max_tokens"]["results"]
    assert [r["tokens"] for r in results] == plain["max_tokens"]
    assert [len(r["tokens"]) for r in results] == STOP_MAX
    assert all(r["finish_reason"] == "length" for r in results)


def test_stop_string_inside_a_draft_block(served, stops):
    jobs, _ = served
    for i, (_, expected) in enumerate(stops):
        r = jobs[f"stop{i}"]["results"][0]
        assert (r["text"], r["finish_reason"]) == (expected, "stop")


def test_abort_leaves_other_requests_unchanged(served, plain):
    jobs, _ = served
    results = jobs["abort"]["results"]
    for i, r in enumerate(results):
        if i in ABORTED:
            assert r is None or r["finish_reason"] == "abort"
        else:
            assert r["tokens"] == plain["c8"][i]


def test_gpu_row_path_keeps_outputs_and_acceptance(masked_rows, served, plain):
    jobs, log = masked_rows
    assert "device-path probe: rejected rows masked to slot -1" in log
    assert jobs["mixed64"]["spec"]["preemptions"] > 0
    for job in ("c8", "mixed64"):
        assert _tokens(jobs[job]) == plain[job]
        tau = mean_acceptance_length(jobs[job]["spec"])
        assert tau == pytest.approx(mean_acceptance_length(served[0][job]["spec"]), rel=0.02)


def test_64_concurrent_mixed_requests_with_preemption(served, plain):
    jobs, _ = served
    assert jobs["mixed64"]["spec"]["preemptions"] > 0, "the small KV cache should preempt"
    assert _tokens(jobs["mixed64"]) == plain["mixed64"]
