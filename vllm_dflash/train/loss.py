"""The DFlash training loss: cross-entropy on mask slots, decayed by slot (paper Eq. 4).

One rejected draft token discards every token after it, so slot k (k = 1 is the first
mask) only pays off when slots 1..k-1 were right. The loss weighs it by
w_k = exp(-(k-1)/gamma_d).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

# The paper's settings; other block sizes interpolate linearly between them (B/2 below 8,
# 7B/16 above 16), which keeps w_{B-1} in the same range the paper used.
PAPER_DECAY_GAMMA = {8: 4.0, 10: 5.0, 16: 7.0}


def default_decay_gamma(block_size: int) -> float:
    if block_size in PAPER_DECAY_GAMMA:
        return PAPER_DECAY_GAMMA[block_size]
    if block_size < 8:
        return block_size / 2
    if block_size > 16:
        return 7.0 * block_size / 16
    lo = max(b for b in PAPER_DECAY_GAMMA if b < block_size)
    hi = min(b for b in PAPER_DECAY_GAMMA if b > block_size)
    t = (block_size - lo) / (hi - lo)
    return PAPER_DECAY_GAMMA[lo] + t * (PAPER_DECAY_GAMMA[hi] - PAPER_DECAY_GAMMA[lo])


def decay_weights(block_size: int, decay_gamma: float | None) -> torch.Tensor:
    """w_k for k = 1..B-1; ``decay_gamma=None`` means no decay (all ones)."""
    k = torch.arange(1, block_size, dtype=torch.float32)
    if decay_gamma is None:
        return torch.ones_like(k)
    return torch.exp(-(k - 1) / decay_gamma)


@dataclass
class LossSums:
    """One micro-batch's loss as sums, so that slices of a global batch (one per rank) add
    up to the whole batch's loss and accuracy."""

    weighted_ce: torch.Tensor  # [] sum of w_k * CE over labelled slots (carries the graph)
    weight: torch.Tensor  # [] sum of w_k over labelled slots
    hits: torch.Tensor  # [B-1] top-1 hits per slot
    labelled: torch.Tensor  # [B-1] labelled slots per slot


def block_loss_sums(
    logits: torch.Tensor,  # [b, n, B-1, V]
    labels: torch.Tensor,  # [b, n, B-1], -100 = ignore
    weights: torch.Tensor,  # [B-1]
) -> LossSums:
    """Weighted CE over mask slots, and top-1 hits, as sums over the batch."""
    ce = F.cross_entropy(
        logits.float().flatten(0, 2), labels.flatten(), ignore_index=-100, reduction="none"
    ).view(labels.shape)
    valid = (labels != -100).float()
    w = weights.to(ce.device) * valid
    with torch.no_grad():
        hits = ((logits.argmax(-1) == labels).float() * valid).sum((0, 1))
    return LossSums((ce * w).sum(), w.sum().detach(), hits, valid.sum((0, 1)))


def block_loss(
    logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Weighted CE over mask slots.

    logits [b, n, B-1, V], labels [b, n, B-1] (-100 = ignore), weights [B-1]. Returns the
    loss (weighted mean over labelled slots) and per-slot top-1 accuracy [B-1] (NaN where no
    slot was labelled) for logging."""
    s = block_loss_sums(logits, labels, weights)
    return s.weighted_ce / s.weight.clamp(min=1e-9), s.hits / s.labelled
