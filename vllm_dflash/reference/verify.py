"""Verification of one drafted block against the target (docs/architecture.md §2).

Both functions take the target's outputs for the block [anchor, d_1 .. d_g] — row i is the
target's prediction for the slot of d_{i+1}, row g the bonus slot — and return
(m, next_token): m drafted tokens accepted, then one token from the target.
"""

from __future__ import annotations

import torch


def verify_greedy(draft_tokens: torch.Tensor, target_logits: torch.Tensor) -> tuple[int, int]:
    """Accept while the draft equals the target argmax; the first mismatch or the bonus
    slot contributes the target's argmax."""
    g = draft_tokens.shape[0]
    target_argmax = target_logits[: g + 1].argmax(-1)
    matches = (draft_tokens == target_argmax[:g]).int()
    m = int(matches.cumprod(0).sum())
    return m, int(target_argmax[m])


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)): what to sample after rejecting a token drawn from q."""
    r = (p - q).clamp_min(0.0)
    total = r.sum()
    # r is all-zero only when p == q up to rounding, where rejection has probability ~0;
    # p is then the exact answer.
    return r / total if total > 0 else p


def verify_rejection(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    generator: torch.Generator | None,
) -> tuple[int, int]:
    """Sequence rejection sampling with draft marginals q_i.

    draft_tokens [g] were drawn t_i ~ q_i = draft_probs[i]; target_probs [g+1, V] are the
    target's distributions given the accepted prefix. Accept t_i with probability
    min(1, p_i(t_i) / q_i(t_i)); on the first reject sample norm(max(0, p_i - q_i));
    after g accepts sample the bonus from p_g. The result is an exact sample of p.
    """
    g = draft_tokens.shape[0]
    u = torch.rand(g, generator=generator, dtype=torch.float64)
    for i in range(g):
        t = int(draft_tokens[i])
        p, q = float(target_probs[i, t]), float(draft_probs[i, t])
        if u[i] * q < p:
            continue
        r = residual_distribution(target_probs[i], draft_probs[i])
        return i, int(torch.multinomial(r, 1, generator=generator))
    return g, int(torch.multinomial(target_probs[g], 1, generator=generator))
