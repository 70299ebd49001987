"""A few hundred steps of self-distillation, so tests get a drafter that is often right.

A random drafter is almost never accepted, and then an acceptance-length comparison proves
little: a drafter fed the wrong context would score the same ~1.0. This trains a factory
drafter on its target's own greedy continuations (the paper's self-distillation), with
random anchors and several blocks per sequence in one forward, each block seeing the context
before its anchor and its own block only. It is the smallest version of the recipe that the
training pipeline implements in full; tests use it, nothing ships it.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

from vllm_dflash.checkpoint import load_drafter_checkpoint, save_drafter_checkpoint
from vllm_dflash.reference.generate import target_generate
from vllm_dflash.reference.model import DFlashDrafter
from vllm_dflash.reference.target import HFTarget


def _block_mask(anchors: list[int], block: int, ctx_len: int) -> torch.Tensor:
    """[n*B, T + n*B] True where a query may attend: context before its anchor, own block."""
    n = len(anchors)
    q_block = torch.arange(n * block) // block
    ctx_ok = torch.arange(ctx_len)[None, :] < torch.tensor(anchors)[q_block][:, None]
    own_ok = q_block[:, None] == q_block[None, :]
    return torch.cat([ctx_ok, own_ok], dim=1)


def distill(
    target: HFTarget,
    drafter_dir: str | Path,
    out: str | Path,
    prompts: Sequence[Sequence[int]],
    *,
    new_tokens: int = 64,
    steps: int = 300,
    blocks_per_step: int = 8,
    lr: float = 3e-3,
    decay: float = 5.0,
    seed: int = 0,
) -> Path:
    ckpt = load_drafter_checkpoint(drafter_dir)
    cfg = ckpt.config
    model = DFlashDrafter(cfg)
    model.load_state_dict(ckpt.state_dict)
    torch.manual_seed(seed)
    rng = random.Random(seed)
    target.model.requires_grad_(False)  # frozen: gradients flow through it to the drafter
    b = cfg.block_size
    data = []
    with torch.no_grad():
        for p in prompts:
            seq = list(p) + target_generate(target, p, new_tokens).tokens
            target.reset()
            _, feats = target.forward(seq, cfg.target_layer_ids)
            data.append((len(p), torch.tensor(seq), feats.float()))
    # Later slots matter less: one miss ends the accepted run (the paper's loss decay).
    weights = torch.exp(-torch.arange(b - 1, dtype=torch.float32) / decay)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    for step in range(steps):
        n_prompt, seq, feats = data[step % len(data)]
        anchors = [rng.randrange(n_prompt - 1, len(seq) - b + 1) for _ in range(blocks_per_step)]
        ids = torch.full((len(anchors), b), cfg.mask_token_id)
        ids[:, 0] = seq[anchors]
        positions = (torch.tensor(anchors)[:, None] + torch.arange(b)).reshape(1, -1)
        with torch.no_grad():
            embeds = target.embed(ids.reshape(1, -1)).float()
        ctx_kv = model.context_kv(feats[None], torch.arange(len(seq))[None])
        mask = _block_mask(anchors, b, len(seq))[None, None]
        hidden = model.forward_block(embeds, positions, ctx_kv, attn_mask=mask)
        logits = target.lm_head(hidden.to(target.dtype)).float().view(len(anchors), b, -1)
        labels = seq[positions.view(len(anchors), b)[:, 1:]]
        ce = F.cross_entropy(logits[:, 1:].transpose(1, 2), labels, reduction="none")
        loss = (ce * weights).sum(-1).mean() / weights.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    state = {k: v.to(ckpt.state_dict[k].dtype) for k, v in model.state_dict().items()}
    return save_drafter_checkpoint(out, cfg, state)
