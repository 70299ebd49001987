"""Sampling DFlash reproduces the target's distribution exactly (docs/architecture.md §2).

On a 12-token vocabulary the exact law of the first five generated tokens is enumerated from
the target (12**5 cells). Token 1 comes from prefill; at block 4, tokens 2-5 are draft slots
1-3 and the bonus slot of the first verify step (when accepted), so every slot of the chain is
covered. N generations are checked with chi-square goodness-of-fit tests (cells expected
below 5 pooled into one): the joint law of tokens 1-3, and the marginal laws of tokens 4
and 5.

False-alarm rate: each check rejects a correct sampler with probability ALPHA = 1e-4, so one
test function (3 checks) fails by chance with probability <= 3e-4 and the module (7 lossless
tests, 21 checks) with <= 2.1e-3. (At 1e-3 per check, one of 21 checks failed by chance: p =
6e-4 for token 4, while four other seeds and an 8000-sample run gave p >= 0.013 there.) Seeds
are fixed and torch runs one thread (conftest), so outcomes are reproducible. The
broken-verifier tests show the checks still have power at this level.
"""

from __future__ import annotations

import pytest
import stats
import torch
from factory import make_drafter, make_target
from oracles import MarginalOracleDrafter, exact_joint

from vllm_dflash.reference import generate, verify
from vllm_dflash.reference.drafter import ReferenceDrafter
from vllm_dflash.reference.generate import GenerationResult, spec_generate, target_generate
from vllm_dflash.reference.sampling import SamplingConfig
from vllm_dflash.reference.target import HFTarget

ALPHA = 1e-4
N = 2000
NEW = 5
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


def p_values(results: list[GenerationResult], joint: torch.Tensor) -> dict[str, float]:
    """p-values for the joint of tokens 1-3 and the marginals of tokens 4 and 5."""
    return stats.p_values(torch.tensor([r.tokens for r in results]), joint)


def assert_lossless(results: list[GenerationResult], joint: torch.Tensor) -> None:
    ps = p_values(results, joint)
    assert min(ps.values()) > ALPHA, ps


def run(gen_fn, n=N, seed=0) -> list[GenerationResult]:
    g = torch.Generator().manual_seed(seed)
    return [gen_fn(g) for _ in range(n)]


@pytest.fixture(scope="module")
def joints(small):
    target, _ = small
    return {s: exact_joint(target.model, PROMPT, NEW, s) for s in (T1, FILTERED)}


def test_harness_accepts_target_only_sampling(small, joints):
    target, _ = small
    results = run(lambda g: target_generate(target, PROMPT, NEW, T1, generator=g))
    assert_lossless(results, joints[T1])


@pytest.mark.parametrize("block_size", [2, 4])
@pytest.mark.parametrize("sampling", [T1, FILTERED], ids=["t1", "t0.8-topk6-topp0.9"])
def test_bad_drafter_is_lossless(small, joints, block_size, sampling):
    target, drafters = small
    drafter = drafters[block_size]
    results = run(lambda g: spec_generate(target, drafter, PROMPT, NEW, sampling, generator=g))
    assert_lossless(results, joints[sampling])
    rejects = sum(m < n for r in results for m, n in zip(r.accepted, r.drafted, strict=True))
    assert rejects > N // 4, "the bad drafter must exercise the residual path"


@pytest.mark.parametrize("block_size", [2, 4])
def test_marginal_drafter_is_lossless(small, joints, block_size):
    target, _ = small
    drafter = MarginalOracleDrafter(target.model, block_size, T1)
    results = run(lambda g: spec_generate(target, drafter, PROMPT, NEW, T1, generator=g))
    assert_lossless(results, joints[T1])
    # With q equal to the target's marginal the first slot is always accepted.
    assert all(r.accepted[0] >= 1 for r in results)


def _accept_late_slots(drafts, draft_probs, target_probs, generator):
    """A verifier bug: slots 1-2 are verified, every later slot is accepted unchecked."""
    m, nxt = verify.verify_rejection(drafts[:2], draft_probs[:2], target_probs[:3], generator)
    if m < 2:
        return m, nxt
    g = drafts.shape[0]
    return g, int(torch.multinomial(target_probs[g], 1, generator=generator))


@pytest.mark.parametrize(
    ("module", "name", "bug"),
    [
        # Sampling p instead of norm(max(0, p - q)) after a reject: a classic mistake.
        (verify, "residual_distribution", lambda p, q: p),
        # Skipping the check of deep slots: only tokens 4-5 can reveal it.
        (generate, "verify_rejection", _accept_late_slots),
    ],
    ids=["residual-is-p", "late-slots-unchecked"],
)
def test_broken_verifier_is_detected(small, joints, monkeypatch, module, name, bug):
    target, drafters = small
    monkeypatch.setattr(module, name, bug)
    results = run(lambda g: spec_generate(target, drafters[4], PROMPT, NEW, T1, generator=g))
    ps = p_values(results, joints[T1])
    assert min(ps.values()) < ALPHA, f"bug not detected: {ps}"
