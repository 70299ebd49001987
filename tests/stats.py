"""Goodness-of-fit checks that sampled tokens follow an exactly known distribution."""

from __future__ import annotations

import torch
from oracles import marginal
from scipy.stats import chi2


def gof_p(outcomes: torch.Tensor, probs: torch.Tensor) -> float:
    """Chi-square goodness-of-fit p-value of outcome indices against exact probabilities."""
    expected = probs.flatten().double() * len(outcomes)
    observed = torch.bincount(outcomes, minlength=expected.numel()).double()
    big = expected >= 5
    e, o = expected[big], observed[big]
    if (~big).any():  # pool the sparse cells into one bin
        e = torch.cat([e, expected[~big].sum()[None]])
        o = torch.cat([o, observed[~big].sum()[None]])
    assert (e > 0).all()
    stat = float(((o - e) ** 2 / e).sum())
    p = float(chi2.sf(stat, len(e) - 1))
    assert p == p, "p-value is NaN"
    print(f"chi-square: {len(e)} bins, statistic {stat:.1f}, p = {p:.3g}")  # see with -s
    return p


def p_values(tokens: torch.Tensor, joint: torch.Tensor) -> dict[str, float]:
    """p-values for the joint law of tokens 1-3 and the marginal law of every later token.

    ``tokens`` is [N, n] generated ids, ``joint`` the exact [V]*n law of n tokens."""
    n, vocab = joint.dim(), joint.shape[0]
    assert tokens.shape[1] == n >= 3
    first3 = (tokens[:, 0] * vocab + tokens[:, 1]) * vocab + tokens[:, 2]
    out = {"tokens 1-3": gof_p(first3, joint.sum(dim=tuple(range(3, n))))}
    for k in range(3, n):
        out[f"token {k + 1}"] = gof_p(tokens[:, k], marginal(joint, k))
    return out
