"""The DFlash drafter in plain PyTorch — the oracle every other implementation is checked against.

Shapes: b = batch, t = context positions, s = block positions (= block_size at inference),
h = hidden, n/k = query/KV heads, d = head_dim, F = concatenated target-feature width.

One drafting step, per docs/architecture.md §1:

    ctx   = hidden_norm(fc(target_features))                    [b, t, h]   (once per position)
    for every layer l:
        K_ctx, V_ctx = rope(k_norm(k_proj_l(ctx))), v_proj_l(ctx)   -> drafter K/V cache
        block attends, without a mask, to [K_ctx ++ K_block]        (bidirectional in-block)
    logits = target.lm_head(norm(h_block))[1:]                  (the anchor slot predicts nothing)

The same k_proj/v_proj serve context and block; positions continue the sequence.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from vllm_dflash.config import DrafterConfig

try:  # torch >= 2.5; training uses it for many isolated blocks per sequence
    from torch.nn.attention.flex_attention import flex_attention
except ImportError:  # pragma: no cover - older torch: the dense-mask path serves
    flex_attention = None


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [..., d] for integer positions (neox / rotate-half layout, as Qwen3)."""
    inv_freq = 1.0 / (
        theta
        ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=positions.device) / head_dim)
    )
    freqs = positions.to(torch.float64)[..., None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [b, heads, t, d]; cos/sin: [b, t, d]."""
    cos, sin = cos[:, None], sin[:, None]
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


@dataclass
class DrafterKVCache:
    """Committed context K/V per layer: [b, k, t, d]. Mask slots are never stored here."""

    keys: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)

    @property
    def length(self) -> int:
        return 0 if not self.keys else self.keys[0].shape[2]

    def per_layer(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return list(zip(self.keys, self.values, strict=True))

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        if layer == len(self.keys):
            self.keys.append(k)
            self.values.append(v)
        else:
            self.keys[layer] = torch.cat([self.keys[layer], k], dim=2)
            self.values[layer] = torch.cat([self.values[layer], v], dim=2)


class DrafterAttention(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        h, d = cfg.hidden_size, cfg.resolved_head_dim
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, d
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(h, self.n_heads * d, bias=bias)
        self.k_proj = nn.Linear(h, self.n_kv * d, bias=bias)
        self.v_proj = nn.Linear(h, self.n_kv * d, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * d, h, bias=bias)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)

    def _heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        b, t, _ = x.shape
        return x.view(b, t, n, self.head_dim).transpose(1, 2)  # [b, n, t, d]

    def kv(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Post-norm, post-RoPE K and V for inputs x [b, t, h] -> [b, k, t, d] each."""
        k = apply_rope(self.k_norm(self._heads(self.k_proj(x), self.n_kv)), cos, sin)
        return k, self._heads(self.v_proj(x), self.n_kv)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        ctx_k: torch.Tensor,
        ctx_v: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x [b, s, h] attends to [ctx ++ block]; no mask means fully bidirectional."""
        b, s, _ = x.shape
        q = apply_rope(self.q_norm(self._heads(self.q_proj(x), self.n_heads)), cos, sin)
        k_blk, v_blk = self.kv(x, cos, sin)
        k = torch.cat([ctx_k, k_blk], dim=2)
        v = torch.cat([ctx_v, v_blk], dim=2)
        if hasattr(attn_mask, "mask_mod"):  # a flex-attention BlockMask (training)
            out = flex_attention(q, k, v, block_mask=attn_mask, enable_gqa=True)
        else:
            rep = self.n_heads // self.n_kv
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)  # [b, n, s, d]
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class DrafterMLP(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DrafterLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.self_attn = DrafterAttention(cfg)
        self.mlp = DrafterMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        ctx_k: torch.Tensor,
        ctx_v: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx_k, ctx_v, attn_mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDrafter(nn.Module):
    """Drafter weights with the z-lab key names; the target's embedding/LM head stay outside."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.cfg = cfg
        self.fc = nn.Linear(cfg.feature_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DrafterLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype):
        return rope_cos_sin(
            positions, self.cfg.resolved_head_dim, self.cfg.resolved_rope_theta, dtype
        )

    def fuse(self, target_features: torch.Tensor) -> torch.Tensor:
        """[b, t, F] concatenated target hidden states -> [b, t, h] context features."""
        return self.hidden_norm(self.fc(target_features))

    def context_kv(
        self, target_features: torch.Tensor, positions: torch.Tensor
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-layer context K/V [b, k, t, d] for positions [b, t]."""
        ctx = self.fuse(target_features)
        cos, sin = self._rope(positions, ctx.dtype)
        return [layer.self_attn.kv(ctx, cos, sin) for layer in self.layers]

    @torch.no_grad()
    def commit_context(
        self, cache: DrafterKVCache, target_features: torch.Tensor, positions: torch.Tensor
    ) -> None:
        """Write K/V for newly verified positions into the cache (computed once each)."""
        if target_features.shape[1] == 0:
            return
        for i, (k, v) in enumerate(self.context_kv(target_features, positions)):
            cache.append(i, k, v)

    def forward(
        self,
        target_features: torch.Tensor,  # [b, t, F]
        context_positions: torch.Tensor,  # [b, t]
        block_embeds: torch.Tensor,  # [b, s, h]
        positions: torch.Tensor,  # [b, s]
        attn_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The training step's pass: context K/V of every position, then all blocks at once
        (``train/blocks.py`` builds the mask). One call, so DDP and FSDP see a forward."""
        ctx_kv = self.context_kv(target_features, context_positions)
        return self.forward_block(block_embeds, positions, ctx_kv, attn_mask)

    def forward_block(
        self,
        block_embeds: torch.Tensor,
        positions: torch.Tensor,
        ctx_kv: list[tuple[torch.Tensor, torch.Tensor]],
        attn_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Final hidden states [b, s, h] of block inputs [b, s, h] at positions [b, s]."""
        cos, sin = self._rope(positions, block_embeds.dtype)
        x = block_embeds
        for layer, (ck, cv) in zip(self.layers, ctx_kv, strict=True):
            x = layer(x, cos, sin, ck, cv, attn_mask)
        return self.norm(x)
