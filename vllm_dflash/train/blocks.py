"""Training blocks: where anchors go, and which keys each block's queries may see.

A training sequence is ``prompt ++ response`` (the target's own response). A block starts at
an anchor position a inside the response: slot 0 holds the clean token at a, slots 1..B-1
hold <mask> and are trained to predict tokens a+1..a+B-1. This mirrors serving exactly: the
anchor is the token the target just emitted, so its own target features do not exist yet,
and the block sees context features at positions < a plus the anchor token itself (slot 0).

Many blocks share one forward. Keys are laid out as ``[T context positions] ++ [n*B block
slots]``; a query in block i may attend to

* context position p  iff  p < anchor_i          (what the target had verified), and
* block slot j        iff  j // B == i           (its own block, bidirectionally);

blocks never see each other. The same rule is built as a dense boolean mask and as a
flex-attention ``mask_mod``; tests check both against a brute-force loop.

A block may also be trained shorter than B (``lens``): serving with fewer speculative tokens
drafts a block of K+1 < B slots, whose masks see fewer masks beside them. A block of length L
keeps the B-slot layout, but its slots >= L are neither keys nor labels, so it computes
exactly what drafting a block of L computes.
"""

from __future__ import annotations

import random
from typing import Literal

import torch

try:
    from torch.nn.attention.flex_attention import BlockMask, create_block_mask
except ImportError:  # pragma: no cover - older torch
    BlockMask = create_block_mask = None

AnchorMode = Literal["random", "grid"]


def sample_anchors(
    rng: random.Random, prompt_len: int, seq_len: int, block: int, n: int, mode: AnchorMode
) -> list[int]:
    """Up to ``n`` distinct, sorted anchor positions in the response region.

    An anchor a needs at least one label (a+1 < seq_len) and must be a response token
    (a >= prompt_len); labels past the sequence end are ignored, so a short response still
    trains its last block. ``random``: any such position (paper §4). ``grid``: positions
    prompt_len + k*B only, the fixed block partition the paper ablates against."""
    lo, hi = prompt_len, seq_len - 2
    if hi < lo:
        return []
    step = block if mode == "grid" else 1
    candidates = range(lo, hi + 1, step)
    return sorted(rng.sample(candidates, min(n, len(candidates))))


def sample_block_lens(rng: random.Random, n: int, sizes: list[int]) -> list[int]:
    """A length for each of ``n`` blocks, drawn uniformly from ``sizes``."""
    return [rng.choice(sizes) for _ in range(n)]


def block_inputs(
    seqs: torch.Tensor,  # [b, T] right-padded token ids
    lengths: torch.Tensor,  # [b] each sequence's own length (<= T)
    anchors: torch.Tensor,  # [b, n], -1 = padding block
    block: int,
    mask_id: int,
    lens: torch.Tensor | None = None,  # [b, n] each block's length (<= block); None = block
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Block token ids and positions [b, n*B], and labels [b, n, B-1]: -100 where the label
    is past its own sequence's end (padding is never a label), past its block's length, or
    in a padding block."""
    b, n = anchors.shape
    offs = torch.arange(block)
    pos = anchors.clamp(min=0)[:, :, None] + offs  # [b, n, B]
    ids = torch.full((b, n, block), mask_id, dtype=torch.long)
    ids[:, :, 0] = seqs.gather(1, anchors.clamp(min=0))
    target_pos = pos[:, :, 1:]
    T = seqs.shape[1]
    labels = seqs.gather(1, target_pos.clamp(max=T - 1).reshape(b, -1)).view(b, n, block - 1)
    invalid = (target_pos >= lengths[:, None, None]) | (anchors[:, :, None] < 0)
    if lens is not None:
        invalid |= offs[1:] >= lens[:, :, None]
    labels = labels.masked_fill(invalid, -100)
    return ids.view(b, -1), pos.view(b, -1), labels


def dense_block_mask(
    anchors: torch.Tensor,  # [b, n], -1 = padding block
    ctx_len: int,
    block: int,
    lens: torch.Tensor | None = None,  # [b, n] each block's length; None = block
) -> torch.Tensor:
    """Boolean mask [b, 1, n*B, T + n*B]: True where a block query may attend."""
    b, n = anchors.shape
    dev = anchors.device
    slot = torch.arange(n * block, device=dev)
    q_block = slot // block  # [n*B]
    ctx_ok = torch.arange(ctx_len, device=dev)[None, None, :] < anchors[:, q_block, None]
    own_ok = (q_block[:, None] == q_block[None, :]).expand(b, -1, -1)  # [b, nB, nB]
    if lens is not None:  # keys past their block's length do not exist
        own_ok = own_ok & ((slot % block)[None, :] < lens[:, q_block])[:, None, :]
    return torch.cat([ctx_ok, own_ok], dim=2)[:, None]


def flex_block_mask(
    anchors: torch.Tensor, ctx_len: int, block: int, lens: torch.Tensor | None = None
) -> BlockMask:
    """The same rule as :func:`dense_block_mask`, as a flex-attention BlockMask."""
    if create_block_mask is None:
        raise RuntimeError("this torch has no flex attention; use attention='dense'")
    b, n = anchors.shape
    anchors = anchors.to(torch.long)
    lens = torch.full_like(anchors, block) if lens is None else lens.to(anchors)

    def mask_mod(bi, h, q_idx, kv_idx):
        qb = q_idx // block
        ctx_ok = (kv_idx < ctx_len) & (kv_idx < anchors[bi, qb])
        kv_slot = kv_idx - ctx_len
        own_ok = (kv_slot >= 0) & (kv_slot // block == qb) & (kv_slot % block < lens[bi, qb])
        return ctx_ok | own_ok

    return create_block_mask(
        mask_mod, b, None, n * block, ctx_len + n * block, device=str(anchors.device)
    )


def flex_available() -> bool:
    return create_block_mask is not None
