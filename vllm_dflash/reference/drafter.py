"""Stateful block drafting for one sequence with the reference DFlash drafter."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import torch

from vllm_dflash.checkpoint import load_drafter_checkpoint
from vllm_dflash.config import DrafterConfig, check_compatible
from vllm_dflash.reference.model import DFlashDrafter, DrafterKVCache
from vllm_dflash.reference.target import HFTarget


class BlockDrafter(Protocol):
    """What the generation loop needs from a drafter.

    ``draft_logits`` receives the target features of the positions verified since the
    previous call (to commit), the anchor (last verified token, not yet seen by the target)
    and its position, plus the whole verified sequence for drafters that want tokens.
    It returns logits [block_size - 1, V] for the slots after the anchor.
    """

    block_size: int
    # Target layers whose outputs ``new_features`` concatenates (may be empty).
    feature_layers: Sequence[int]

    def reset(self) -> None: ...

    def draft_logits(
        self,
        new_features: torch.Tensor,
        anchor_token: int,
        anchor_position: int,
        verified_tokens: Sequence[int],
    ) -> torch.Tensor: ...


class ReferenceDrafter:
    """DFlash drafting with the target's frozen embedding and LM head.

    Context K/V are computed once per verified position and committed; the block's
    anchor and mask slots are recomputed every step and never stored.
    """

    def __init__(self, model: DFlashDrafter, target: HFTarget, block_size: int | None = None):
        self.model = model.eval().requires_grad_(False)
        self.target = target
        self.cfg: DrafterConfig = model.cfg
        # Serving may draft fewer tokens than the trained block (vLLM's
        # num_speculative_tokens < block_size - 1): the block is then anchor + fewer masks.
        self.block_size = block_size or self.cfg.block_size
        if not 2 <= self.block_size <= self.cfg.block_size:
            raise ValueError(
                f"block_size={self.block_size}: must be in [2, {self.cfg.block_size}] "
                "(the drafter's trained block)"
            )
        self.feature_layers = self.cfg.target_layer_ids
        self.cache = DrafterKVCache()

    @classmethod
    def load(
        cls, path: str | Path, target: HFTarget, block_size: int | None = None
    ) -> ReferenceDrafter:
        ckpt = load_drafter_checkpoint(path)
        check_compatible(ckpt.config, target.config)
        model = DFlashDrafter(ckpt.config)
        model.load_state_dict(ckpt.state_dict, strict=True)
        return cls(model.to(target.dtype), target, block_size)

    def reset(self) -> None:
        self.cache = DrafterKVCache()

    @torch.no_grad()
    def draft_logits(
        self,
        new_features: torch.Tensor,
        anchor_token: int,
        anchor_position: int,
        verified_tokens: Sequence[int] = (),
    ) -> torch.Tensor:
        start = self.cache.length
        if start + new_features.shape[0] != anchor_position:
            raise RuntimeError(
                f"drafter cache holds {start} positions + {new_features.shape[0]} new, "
                f"but the anchor sits at position {anchor_position}"
            )
        self.model.commit_context(
            self.cache,
            new_features[None],
            torch.arange(start, anchor_position, device=new_features.device)[None],
        )
        device = self.target.device
        block = torch.full(
            (1, self.block_size), self.cfg.mask_token_id, dtype=torch.long, device=device
        )
        block[0, 0] = anchor_token
        positions = torch.arange(anchor_position, anchor_position + self.block_size, device=device)
        positions = positions[None]
        hidden = self.model.forward_block(
            self.target.embed(block), positions, self.cache.per_layer()
        )
        return self.target.lm_head(hidden[0, 1:])
