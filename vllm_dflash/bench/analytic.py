"""The analytic speedup model of speculative decoding (docs/architecture.md §4).

One verify step costs T_draft + T_verify and commits tau tokens on average, whereas plain
decoding costs L_target per token, so

    eta = L_target / ((T_draft + T_verify) / tau)

tau follows from per-position acceptance. Two conventions exist and both are supported:

* conditional: a_k = P(slot k accepted | slots 1..k-1 accepted)  (what a drafter "is")
* cumulative:  c_k = P(slots 1..k all accepted) = prod_{j<=k} a_j  (what vLLM's per-position
  counters measure: accepted-at-position-k / number of drafts)

    tau = 1 + sum_k c_k      (the 1 is the token the target always contributes)

Example, the paper's Qwen3-8B b16 worked case: speedup(7.87, 12e-3, 5e-3, 8e-3) = 7.26.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate
from operator import mul


def _check_probs(values: Sequence[float], name: str) -> None:
    for i, v in enumerate(values):
        if not 0.0 <= v <= 1.0:
            raise ValueError(f"{name}[{i}] = {v}: acceptance probabilities lie in [0, 1]")


def cumulative_from_conditional(conditional: Sequence[float]) -> list[float]:
    """c_k = a_1 * ... * a_k."""
    _check_probs(conditional, "conditional")
    return list(accumulate(conditional, mul))


def conditional_from_cumulative(cumulative: Sequence[float]) -> list[float]:
    """a_k = c_k / c_{k-1}; a slot after a certain reject (c_{k-1} = 0) gets 0."""
    _check_probs(cumulative, "cumulative")
    out, prev = [], 1.0
    for i, c in enumerate(cumulative):
        if c > prev + 1e-12:
            raise ValueError(f"cumulative[{i}] = {c} exceeds cumulative[{i - 1}] = {prev}")
        out.append(c / prev if prev > 0 else 0.0)
        prev = c
    return out


def expected_acceptance_length(
    *, conditional: Sequence[float] | None = None, cumulative: Sequence[float] | None = None
) -> float:
    """tau = 1 + sum of cumulative acceptance; give exactly one of the two conventions."""
    if (conditional is None) == (cumulative is None):
        raise ValueError("give exactly one of conditional= or cumulative=")
    if cumulative is None:
        cumulative = cumulative_from_conditional(conditional)
    else:
        conditional_from_cumulative(cumulative)  # validates monotonicity and range
    return 1.0 + sum(cumulative)


def acceptance_length_iid(alpha: float, draft_len: int) -> float:
    """tau when every slot is accepted with the same conditional probability alpha."""
    return expected_acceptance_length(conditional=[alpha] * draft_len)


def speedup(tau: float, t_target: float, t_draft: float, t_verify: float) -> float:
    """eta = L_target / ((T_draft + T_verify) / tau). Times in any one unit."""
    if tau < 1.0:
        raise ValueError(f"tau = {tau}: at least one token is committed per step")
    if t_target <= 0 or t_draft < 0 or t_verify <= 0:
        raise ValueError("times must be positive (t_draft may be 0)")
    return t_target * tau / (t_draft + t_verify)


def break_even_acceptance_length(t_target: float, t_draft: float, t_verify: float) -> float:
    """The tau at which speculation stops paying off (eta = 1)."""
    return (t_draft + t_verify) / t_target
