"""Verification rules in isolation: greedy chain, rejection sampling, logits processing."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from vllm_dflash.reference.sampling import SamplingConfig, probs_from_logits
from vllm_dflash.reference.verify import residual_distribution, verify_greedy, verify_rejection


def _onehot_logits(tokens, vocab=10):
    logits = torch.zeros(len(tokens), vocab)
    logits[torch.arange(len(tokens)), torch.tensor(tokens)] = 5.0
    return logits


@pytest.mark.parametrize(
    ("draft", "target", "want"),
    [
        ([1, 2, 3], [1, 2, 3, 4], (3, 4)),  # all accepted: bonus from the last row
        ([1, 2, 3], [5, 2, 3, 4], (0, 5)),  # first slot wrong: the target's token replaces it
        ([1, 2, 3], [1, 2, 7, 4], (2, 7)),  # mismatch mid-block
        ([1, 9, 3], [1, 2, 3, 4], (1, 2)),  # later matches after a mismatch do not count
    ],
)
def test_greedy_chain(draft, target, want):
    assert verify_greedy(torch.tensor(draft), _onehot_logits(target)) == want


def test_residual_is_positive_part_normalised():
    p = torch.tensor([0.5, 0.3, 0.2])
    q = torch.tensor([0.2, 0.6, 0.2])
    torch.testing.assert_close(residual_distribution(p, q), torch.tensor([1.0, 0.0, 0.0]))
    torch.testing.assert_close(residual_distribution(p, p), p)


def _random_dists(g, vocab, seed, sharp=2.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(g, vocab, generator=gen) * sharp).softmax(-1)


def test_rejection_emits_exact_target_samples_at_every_slot():
    """Rows p_k stand for the target given the accepted prefix. Given that slots 0..k-1 were
    accepted, the token emitted at slot k (draft, residual, or the bonus at k = g) must follow
    p_k; slot k's randomness is independent of the event, so each slot is tested on its own.
    q is a blend of p and noise so that every slot, the bonus included, is reached often."""
    g, vocab, n = 3, 6, 20000
    p = _random_dists(g + 1, vocab, 0)
    q = 0.6 * p[:g] + 0.4 * _random_dists(g, vocab, 1)
    gen = torch.Generator().manual_seed(2)
    at_slot: list[list[int]] = [[] for _ in range(g + 1)]
    for _ in range(n):
        drafts = torch.multinomial(q, 1, generator=gen)[:, 0]
        m, nxt = verify_rejection(drafts, q, p, gen)
        for k, tok in enumerate([*drafts[:m].tolist(), nxt]):
            at_slot[k].append(tok)
    for k, samples in enumerate(at_slot):
        assert len(samples) > 1000, f"slot {k} reached only {len(samples)} times"
        counts = torch.bincount(torch.tensor(samples), minlength=vocab).double()
        expected = p[k].double() / p[k].double().sum() * len(samples)
        assert chisquare(counts, expected).pvalue > 1e-4, f"slot {k}"
    assert len(at_slot[1]) < n  # some slot-0 rejections happened


def test_rejection_with_exact_draft_always_accepts():
    p = _random_dists(4, 5, 3)
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        drafts = torch.multinomial(p[:3], 1, generator=gen)[:, 0]
        assert verify_rejection(drafts, p[:3], p, gen)[0] == 3


def test_temperature_top_k_top_p():
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0, -1.0])
    t = probs_from_logits(logits, SamplingConfig(temperature=0.5))
    torch.testing.assert_close(t, (logits / 0.5).softmax(-1))
    k = probs_from_logits(logits, SamplingConfig(temperature=1.0, top_k=2))
    assert (k[2:] == 0).all() and torch.isclose(k.sum(), torch.tensor(1.0))
    full = logits.softmax(-1)  # 0.636, 0.234, 0.086, ...
    tp = probs_from_logits(logits, SamplingConfig(temperature=1.0, top_p=0.8))
    assert (tp[:2] > 0).all() and (tp[2:] == 0).all()
    torch.testing.assert_close(tp[:2], full[:2] / full[:2].sum())
    only_top = probs_from_logits(logits, SamplingConfig(temperature=1.0, top_p=0.1))
    assert only_top[0] == 1.0


def test_greedy_has_no_distribution():
    with pytest.raises(ValueError, match="greedy"):
        probs_from_logits(torch.zeros(3), SamplingConfig())
