"""Pure-PyTorch definitions of the custom ops: what the kernels must compute. The tests
compare every kernel with these; the serving path falls back to vLLM's own ops instead."""

from __future__ import annotations

import torch


def rope(x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, neox: bool):
    """Rotary embedding of ``x`` [N, ..., dim] in fp32; dims past the rotary dim pass."""
    rot = cos_sin_cache.shape[1]
    cos, sin = cos_sin_cache[positions].float().chunk(2, dim=-1)  # [N, rot / 2]
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (rot // 2,)
    cos, sin = cos.view(shape), sin.view(shape)
    r = x[..., :rot].float()
    if neox:
        a, b = r.chunk(2, dim=-1)
        out = torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)
    else:
        a, b = r[..., 0::2], r[..., 1::2]
        out = torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1).flatten(-2)
    return torch.cat([out, x[..., rot:].float()], dim=-1)


def inject_context_kv(
    kv: torch.Tensor,
    k_norm_weight: torch.Tensor,
    eps: float,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
    slots: torch.Tensor,
    key_caches: list[torch.Tensor],
    value_caches: list[torch.Tensor],
) -> None:
    """``torch.ops.vllm_dflash.inject_context_kv``, written out (see csrc/torch_bindings.cpp).

    kv: [N, L, 2, kv_heads, dim]; caches: [blocks, block_size, kv_heads, dim] views."""
    dim = kv.shape[-1]
    k = torch.nn.functional.rms_norm(kv[:, :, 0], (dim,), eps=eps)
    k = k * k_norm_weight[None, :, None, :]
    k = rope(k, positions, cos_sin_cache, is_neox).to(kv.dtype)
    keep = slots >= 0
    block_size = key_caches[0].shape[1]
    blk, off = slots[keep] // block_size, slots[keep] % block_size
    for layer, (kc, vc) in enumerate(zip(key_caches, value_caches, strict=True)):
        kc[blk, off] = k[keep, layer]
        vc[blk, off] = kv[keep, layer, 1]


def qk_norm_rope(
    qkv: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
    num_heads: int,
    num_kv_heads: int,
) -> None:
    """``torch.ops.vllm_dflash.qk_norm_rope``, written out: in place on qkv
    [N, (num_heads + 2 * num_kv_heads) * head_dim]; value heads untouched."""
    n, dim = qkv.shape[0], q_weight.shape[0]
    heads = qkv.view(n, num_heads + 2 * num_kv_heads, dim)
    for part, weight in (
        (slice(0, num_heads), q_weight),
        (slice(num_heads, -num_kv_heads), k_weight),
    ):
        x = torch.nn.functional.rms_norm(heads[:, part].float(), (dim,), weight.float(), eps)
        heads[:, part] = rope(x, positions, cos_sin_cache, is_neox).to(qkv.dtype)
