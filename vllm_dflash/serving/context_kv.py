"""Context K/V into vLLM's paged cache: the fused ``inject_context_kv`` op when it can run,
else the PyTorch path (vLLM's own RoPE and per-layer cache-write ops).

The fused op writes through strided ``[blocks, block_size, kv_heads, head_dim]`` views of each
layer's cache. Which views those are depends on the attention backend (and, on CPU, on the
ISA: its key blocks are stored dimension-major). Rather than keeping a table per backend, the
views are *measured* once per cache allocation: the backend's own ``do_kv_cache_update``
writes one-hot probes into a two-block scratch cache of the same layout, the probes'
positions give the strides, and a write of random rows at block-crossing slots through those
views must equal the backend's write bit for bit. A layout that is not a strided view
(packed, quantised) fails that check, and the PyTorch path serves, with one log line either
way.

Measuring reads results back to the host, so it must not happen inside a CUDA-graph
capture: ``bind`` measures for the cache now bound, and the runner-V2 speculator calls it
before capturing. Without it (runner V1, eager runner V2) the first write measures, outside
any graph; a write during a capture that finds the cache unmeasured is an error, not a
silent sync.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
from torch import nn

from vllm_dflash import ops

logger = logging.getLogger("vllm.plugins.vllm_dflash")


class ContextKvWriter:
    """Normalises, rotates and writes context K/V for all drafter layers.

    ``attns`` are the drafter layers' ``DrafterAttention`` modules (they share head_dim, RoPE
    and kv heads); ``k_norm_weight`` is their k_norm weights stacked, [layers, head_dim]."""

    def __init__(self, attns: Sequence[nn.Module], k_norm_weight: torch.Tensor, eps: float):
        self.attns = list(attns)
        self.k_norm_weight = k_norm_weight
        self.eps = eps
        self.rope = self.attns[0].rotary_emb
        self._fused: tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor] | None = None
        self._decided_for: object | None = None  # the first layer's cache tensor

    def __call__(self, kv: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor | None):
        """``kv`` [N, layers, 2, kv_heads, head_dim] straight from the stacked projection;
        ``positions`` [N] int64; ``slots`` [N] int64 (-1: skip the row), None: compute only."""
        fused = None if slots is None else self._decide(kv.dtype)
        if fused is not None:
            keys, values, cos_sin = fused
            torch.ops.vllm_dflash.inject_context_kv(
                kv,
                self.k_norm_weight,
                self.eps,
                positions,
                cos_sin,
                self.rope.is_neox_style,
                slots,
                keys,
                values,
            )
            return
        self.pytorch_path(kv, positions, slots)

    def pytorch_path(
        self, kv: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor | None
    ) -> None:
        n, layers, _, nkv, hd = kv.shape
        k = nn.functional.rms_norm(kv[:, :, 0], (hd,), eps=self.eps)
        k = k * self.k_norm_weight.view(1, layers, 1, hd)
        # One RoPE call for all layers: they share head_dim, theta and positions.
        k = self.rope(positions.repeat_interleave(layers), k.reshape(n * layers, nkv * hd))[0]
        k = k.view(n, layers, nkv, hd)
        if slots is None:  # vLLM's memory-profiling run: compute only
            return
        for i, attn in enumerate(self.attns):
            layer = attn.attn
            layer.impl.do_kv_cache_update(layer, k[:, i], kv[:, i, 1], layer.kv_cache, slots)

    # ---- choosing the path, once per cache allocation -----------------------------------
    def bind(self, dtype: torch.dtype) -> None:
        """Choose the path for the cache now bound to the layers (``dtype``: the model's)."""
        self._decide(dtype)

    def _decide(
        self, dtype: torch.dtype
    ) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor] | None:
        cache = self.attns[0].attn.kv_cache
        if self._decided_for is cache:
            return self._fused
        device = self.k_norm_weight.device
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "vllm-dflash: the drafter's KV cache was not measured before CUDA-graph "
                "capture (DFlashDraftModel.bind_kv_cache)"
            )
        self._decided_for = cache
        self._fused = None
        why = self._why_not(dtype, device)
        if why is None:
            attn0 = self.attns[0]
            views = [paged_views(a.attn, attn0.num_kv_heads, attn0.head_dim) for a in self.attns]
            if all(v is not None for v in views):
                cos_sin = self.rope.cos_sin_cache.to(device, dtype).contiguous()
                keys = [v[0] for v in views if v is not None]
                values = [v[1] for v in views if v is not None]
                self._fused = (keys, values, cos_sin)
                logger.info(
                    "vllm-dflash: context K/V through the fused inject_context_kv op (%s, %s)",
                    device.type,
                    type(self.attns[0].attn.impl).__name__,
                )
                return self._fused
            why = "the attention backend's cache layout is not a strided view"
        logger.info("vllm-dflash: context K/V on the PyTorch path (%s)", why)
        return None

    def _why_not(self, dtype: torch.dtype, device: torch.device) -> str | None:
        if not ops.has_kernel(device):
            return f"no compiled kernel for {device.type}"
        cache = self.attns[0].attn.kv_cache
        if not isinstance(cache, torch.Tensor) or cache.dtype != dtype:
            return f"KV cache dtype {getattr(cache, 'dtype', None)} is not the model's"
        if len(self.attns) > 16 and device.type == "cuda":
            return "more than 16 drafter layers"
        return None


def paged_views(
    layer: nn.Module, num_kv_heads: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``[blocks, block_size, kv_heads, head_dim]`` views of ``layer.kv_cache`` through which
    a write lands exactly where the backend's ``do_kv_cache_update`` puts it; None if the
    layout is not such a view."""
    cache: torch.Tensor = layer.kv_cache
    per_block = 2 * num_kv_heads * head_dim
    for block_dim, num_blocks in enumerate(cache.shape):
        if num_blocks < 2 or cache.numel() % (num_blocks * per_block):
            continue
        block_size = cache.numel() // (num_blocks * per_block)
        shape = list(cache.shape)
        shape[block_dim] = 2
        scratch = cache.new_zeros(shape)  # two blocks of the same layout
        found = _probe(layer, scratch, block_size, num_kv_heads, head_dim)
        if found is None:
            continue
        dims = (block_size, num_kv_heads, head_dim)
        try:  # strides that leave the storage are no view at all
            views = [_view_of(scratch, idx, 2, *dims) for idx in found]
            if not _same_as_backend(layer, scratch, views, block_size):
                return None
            key, value = (_view_of(cache, idx, num_blocks, *dims) for idx in found)
        except RuntimeError:
            return None
        return key, value
    return None


# Probes as (slot, head, dim): the origin, then one step along dim, head, offset, block.
def _probe_points(block_size: int) -> list[tuple[int, int, int]]:
    return [(0, 0, 0), (0, 0, 1), (0, 1, 0), (1, 0, 0), (block_size, 0, 0)]


def _probe(
    layer: nn.Module, scratch: torch.Tensor, block_size: int, nkv: int, hd: int
) -> list[list[tuple[int, ...]]] | None:
    """Where one-hot probes land, as multi-indices of ``scratch``: [keys, values]."""
    where: list[list[tuple[int, ...]]] = [[], []]
    for slot, h, d in _probe_points(block_size):
        k = torch.zeros(1, nkv, hd, dtype=scratch.dtype, device=scratch.device)
        v = torch.zeros_like(k)
        k[0, min(h, nkv - 1), min(d, hd - 1)] = 1
        v[0, min(h, nkv - 1), min(d, hd - 1)] = 2
        scratch.zero_()
        slots = torch.tensor([slot], dtype=torch.int64, device=scratch.device)
        try:
            layer.impl.do_kv_cache_update(layer, k, v, scratch, slots)
        except Exception:  # noqa: BLE001 - a backend that cannot write this scratch layout
            return None
        for j, mark in enumerate((1, 2)):
            hits = (scratch == mark).nonzero()
            if hits.shape[0] != 1:
                return None
            where[j].append(tuple(hits[0].tolist()))
    return where


def _view_of(
    cache: torch.Tensor, idx: list[tuple[int, ...]], blocks: int, block_size: int, nkv: int, hd: int
) -> torch.Tensor:
    """The [blocks, block_size, heads, dim] view of ``cache`` whose probes sit at ``idx``
    (a stride along a size-1 axis is never used, so its probe may repeat the origin)."""

    def offset(i: tuple[int, ...]) -> int:
        return sum(a * s for a, s in zip(i, cache.stride(), strict=True))

    base = offset(idx[0])
    s_dim, s_head, s_off, s_block = (offset(i) - base for i in idx[1:])
    return cache.as_strided(
        (blocks, block_size, nkv, hd),
        (s_block, s_off, s_head, s_dim),
        cache.storage_offset() + base,
    )


def _same_as_backend(
    layer: nn.Module, scratch: torch.Tensor, views: list[torch.Tensor], block_size: int
) -> bool:
    """Random rows at slots spanning both blocks, written by the backend and through the
    views, must give the same scratch cache, bit for bit."""
    key, value = views
    _, _, nkv, hd = key.shape
    slots = torch.tensor(
        sorted({0, 1, block_size - 1, block_size, 2 * block_size - 1}), device=scratch.device
    )
    gen = torch.Generator(device="cpu").manual_seed(0)
    k, v = (torch.randn(len(slots), nkv, hd, generator=gen).to(scratch) for _ in range(2))
    scratch.zero_()
    layer.impl.do_kv_cache_update(layer, k, v, scratch, slots)
    expected = scratch.clone()
    scratch.zero_()
    key[slots // block_size, slots % block_size] = k
    value[slots // block_size, slots % block_size] = v
    return torch.equal(scratch, expected)
