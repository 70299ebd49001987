"""The analytic speedup model (docs/architecture.md §4)."""

from __future__ import annotations

import random

import pytest
from oracles import GreedyOracleDrafter

from vllm_dflash.bench.analytic import (
    acceptance_length_iid,
    break_even_acceptance_length,
    conditional_from_cumulative,
    cumulative_from_conditional,
    expected_acceptance_length,
    speedup,
)
from vllm_dflash.reference.generate import spec_generate


def test_paper_worked_example():
    # Qwen3-8B b16: (5 ms + 8 ms) / 7.87 vs 12 ms per target token -> 7.3x predicted.
    assert speedup(7.87, 12.0, 5.0, 8.0) == pytest.approx(7.265, abs=1e-3)
    assert break_even_acceptance_length(12.0, 5.0, 8.0) == pytest.approx(13 / 12)


def test_iid_matches_geometric_closed_form():
    for alpha in (0.0, 0.3, 0.8, 1.0):
        for draft_len in (1, 7, 15):
            closed = draft_len + 1 if alpha == 1 else (1 - alpha ** (draft_len + 1)) / (1 - alpha)
            assert acceptance_length_iid(alpha, draft_len) == pytest.approx(closed)


def test_conventions_round_trip():
    cond = [0.9, 0.8, 0.5, 0.0, 0.7]
    cum = cumulative_from_conditional(cond)
    assert cum == pytest.approx([0.9, 0.72, 0.36, 0.0, 0.0])
    assert conditional_from_cumulative(cum)[:4] == pytest.approx(cond[:4])
    assert expected_acceptance_length(conditional=cond) == pytest.approx(1 + sum(cum))
    assert expected_acceptance_length(cumulative=cum) == pytest.approx(1 + sum(cum))


def test_monte_carlo_agrees():
    cond = [0.9, 0.85, 0.7, 0.6, 0.5, 0.4, 0.3]
    rng = random.Random(0)
    n, total = 40000, 0
    for _ in range(n):
        m = 0
        while m < len(cond) and rng.random() < cond[m]:
            m += 1
        total += m + 1
    # Standard error of tau here is < 0.012; allow 4 of them.
    assert total / n == pytest.approx(expected_acceptance_length(conditional=cond), abs=0.05)


def test_per_position_acceptance_uses_the_cumulative_convention(target):
    """tau = 1 + sum(c_k) holds exactly for measured runs when c_k is cumulative."""
    res = spec_generate(target, GreedyOracleDrafter(target.model, 8, accuracy=0.8), [5, 6, 7], 60)
    assert res.acceptance_length == pytest.approx(
        expected_acceptance_length(cumulative=res.per_position_acceptance())
    )


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: cumulative_from_conditional([0.5, 1.2]), r"conditional\[1\] = 1.2"),
        (lambda: conditional_from_cumulative([0.5, 0.6]), "exceeds"),
        (lambda: expected_acceptance_length(), "exactly one"),
        (lambda: speedup(0.5, 1, 1, 1), "tau = 0.5"),
        (lambda: speedup(2, 1, 1, 0), "positive"),
    ],
)
def test_bad_inputs(call, match):
    with pytest.raises(ValueError, match=match):
        call()
