"""Sampling DFlash reproduces the target's distribution exactly (DESIGN.md §2).

On a 12-token vocabulary the exact joint law of the first three generated tokens is
enumerated from the target (12**3 cells). N generations are binned into those cells
(cells expected below 5 pooled into one) and a chi-square goodness-of-fit test is run.

False-alarm rate: a correct sampler fails a test with probability ALPHA = 1e-3; the seeds
are fixed, so the outcome is reproducible. The broken-verifier test shows the test has power.
"""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chi2

from vllm_dflash.reference import verify
from vllm_dflash.reference.drafter import ReferenceDrafter
from vllm_dflash.reference.generate import GenerationResult, spec_generate, target_generate
from vllm_dflash.reference.sampling import SamplingConfig
from vllm_dflash.reference.target import HFTarget
from vllm_dflash.testing.factory import make_drafter, make_target
from vllm_dflash.testing.oracles import MarginalOracleDrafter, exact_joint

ALPHA = 1e-3
N = 2000
PROMPT = [3, 4, 5, 6]
VOCAB = 12
T1 = SamplingConfig(temperature=1.0)
FILTERED = SamplingConfig(temperature=0.8, top_k=6, top_p=0.9)


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    root = tmp_path_factory.mktemp("small-vocab")
    target_dir = make_target(
        root / "target",
        vocab_size=VOCAB,
        hidden_size=32,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        intermediate_size=64,
        init_std=0.25,
    )
    target = HFTarget.from_pretrained(target_dir)
    drafters = {}
    for b in (2, 4):
        # Large random weights: confident and wrong, a deliberately bad drafter.
        d = make_drafter(root / f"b{b}", target_dir, block_size=b, num_layers=1, init_std=1.0)
        drafters[b] = ReferenceDrafter.load(d, target)
    return target, drafters


def chi_square_p(results: list[GenerationResult], joint: torch.Tensor) -> float:
    expected = (joint.flatten() * len(results)).double()
    flat = torch.tensor([(a * VOCAB + b) * VOCAB + c for a, b, c in (r.tokens for r in results)])
    observed = torch.bincount(flat, minlength=expected.numel()).double()
    big = expected >= 5
    e = torch.cat([expected[big], expected[~big].sum()[None]])
    o = torch.cat([observed[big], observed[~big].sum()[None]])
    stat = float(((o - e) ** 2 / e).sum())
    p = float(chi2.sf(stat, int(big.sum())))  # bins - 1 degrees of freedom
    print(f"chi-square: {len(e)} bins, statistic {stat:.1f}, p = {p:.3g}")  # see with -s
    return p


def run(gen_fn, n=N, seed=0) -> list[GenerationResult]:
    g = torch.Generator().manual_seed(seed)
    return [gen_fn(g) for _ in range(n)]


@pytest.fixture(scope="module")
def joints(small):
    target, _ = small
    return {s: exact_joint(target.model, PROMPT, 3, s) for s in (T1, FILTERED)}


def test_harness_accepts_target_only_sampling(small, joints):
    target, _ = small
    results = run(lambda g: target_generate(target, PROMPT, 3, T1, generator=g))
    assert chi_square_p(results, joints[T1]) > ALPHA


@pytest.mark.parametrize("block_size", [2, 4])
@pytest.mark.parametrize("sampling", [T1, FILTERED], ids=["t1", "t0.8-topk6-topp0.9"])
def test_bad_drafter_is_lossless(small, joints, block_size, sampling):
    target, drafters = small
    drafter = drafters[block_size]
    results = run(lambda g: spec_generate(target, drafter, PROMPT, 3, sampling, generator=g))
    p = chi_square_p(results, joints[sampling])
    assert p > ALPHA, f"p = {p:.2e}"
    rejects = sum(m < n for r in results for m, n in zip(r.accepted, r.drafted, strict=True))
    assert rejects > N // 4, "the bad drafter must exercise the residual path"


@pytest.mark.parametrize("block_size", [2, 4])
def test_marginal_drafter_is_lossless(small, joints, block_size):
    target, _ = small
    drafter = MarginalOracleDrafter(target.model, block_size, T1)
    results = run(lambda g: spec_generate(target, drafter, PROMPT, 3, T1, generator=g))
    p = chi_square_p(results, joints[T1])
    assert p > ALPHA, f"p = {p:.2e}"
    # With q equal to the target's marginal the first slot is always accepted.
    assert all(r.accepted[0] >= 1 for r in results)


def test_broken_residual_is_detected(small, joints, monkeypatch):
    """Sampling the target distribution instead of norm(max(0, p - q)) on reject is a classic
    bug; the test above must catch it."""
    target, drafters = small
    monkeypatch.setattr(verify, "residual_distribution", lambda p, q: p)
    results = run(lambda g: spec_generate(target, drafters[4], PROMPT, 3, T1, generator=g))
    p = chi_square_p(results, joints[T1])
    assert p < ALPHA, f"broken residual not detected: p = {p:.2e}"
