"""The compiled ops (csrc/) against their PyTorch definitions (vllm_dflash/ops/reference.py).

Shapes come from real drafter configs; inputs are random, often non-contiguous; slots cross
KV-block boundaries and include padding (-1). Values are copied and must be exact. Keys:
fp32 within 1e-5 (the kernel sums squares in another order than ATen); fp16 / bf16 within
4 units in the last place of the stored type: both round after the norm and after the
weight, and an intermediate that rounds the other way moves both elements of a RoPE pair.
"""

from __future__ import annotations

import math
import zlib

import pytest
import torch

from vllm_dflash import ops
from vllm_dflash.ops import reference


@pytest.fixture(autouse=True, scope="module")
def _extension():
    """Loads the extension in every test process (xdist workers each import this module)."""
    assert ops.load(), "vllm_dflash._C did not load: run `make install` (needs a C++ compiler)"


def test_make_install_built_the_extension():
    """`make install` builds the CPU kernel; everything below runs it."""
    assert "CPU" in ops.kernel_devices()


# (name, drafter layers, kv heads, head_dim, rotary dim): the embedded default, a
# Qwen3-8B-DFlash-b16 drafter, one with partial rotary, a Llama-3.1-8B-style drafter.
CONFIGS = [
    ("embedded", 4, 2, 32, 32),
    ("qwen3-8b-b16", 5, 8, 128, 128),
    ("partial-rotary", 2, 4, 64, 32),
    ("llama-3.1-8b", 5, 8, 128, 128),
]
TOL = {torch.float32: 1e-5, torch.bfloat16: 4 * 2**-8, torch.float16: 4 * 2**-11}


def _cos_sin(max_pos: int, rot: int, dtype: torch.dtype) -> torch.Tensor:
    inv = 1.0 / (10000 ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot))
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(dtype)


def _caches(layers, blocks, block_size, nkv, hd, dtype, layout, gen):
    """Per layer, key and value views [blocks, block_size, heads, dim] of one allocation in
    one of vLLM's layouts: "cpu" is the CPU backend's (value rows [offset, dim], key rows
    dimension-major), "flash" is FlashAttention's [blocks, block_size, heads, 2 * dim]."""
    keys, values = [], []
    for _ in range(layers):
        if layout == "cpu":
            raw = torch.randn(blocks, nkv, block_size, 2 * hd, generator=gen).to(dtype)
            k_raw, v_raw = raw.view(blocks, nkv, 2 * block_size, hd).chunk(2, dim=2)
            k = k_raw.as_strided(
                (blocks, block_size, nkv, hd),
                (raw.stride(0), 1, raw.stride(1), block_size),
                raw.storage_offset(),
            )
            v = v_raw.transpose(1, 2)
        else:
            raw = torch.randn(blocks, block_size, nkv, 2 * hd, generator=gen).to(dtype)
            k, v = raw.split(hd, dim=-1)
        keys.append(k)
        values.append(v)
    return keys, values


def _inputs(cfg, dtype, n, block_size, neox, gen, contiguous):
    _, layers, nkv, hd, rot = cfg
    blocks = max(4, math.ceil(3 * n / block_size) + 1)
    if contiguous:
        kv = torch.randn(n, layers, 2, nkv, hd, generator=gen).to(dtype)
    else:  # a slice of a wider, row-permuted buffer: every stride is unusual
        wide = torch.randn(2 * n, layers, 2, nkv, hd + 8, generator=gen).to(dtype)
        kv = wide[1::2, :, :, :, 3 : 3 + hd]
    weight = (torch.rand(layers, hd, generator=gen) + 0.5).to(dtype)
    positions = torch.randint(0, 2048, (2 * n,), generator=gen)[::2]  # strided
    # Distinct slots anywhere in the cache, consecutive runs crossing block boundaries,
    # and padding.
    slots = torch.randperm(blocks * block_size, generator=gen)[:n]
    run = torch.arange(block_size - 2, block_size + 2)
    slots[: min(n, 4)] = run[: min(n, 4)]
    if n > 5:
        slots[5] = -1
    return kv, weight, positions, _cos_sin(2048, rot, dtype), neox, slots, blocks


@pytest.mark.parametrize("cfg", CONFIGS, ids=[c[0] for c in CONFIGS])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("block_size", [16, 32, 128])
@pytest.mark.parametrize("layout", ["cpu", "flash"])
def test_inject_context_kv_matches_reference(cfg, dtype, block_size, layout):
    gen = torch.Generator().manual_seed(zlib.crc32(f"{cfg[0]}{dtype}{block_size}{layout}".encode()))
    for n, neox, contiguous in [(1, True, True), (7, True, False), (37, False, False)]:
        kv, w, pos, cos_sin, neox, slots, blocks = _inputs(
            cfg, dtype, n, block_size, neox, gen, contiguous
        )
        _, layers, nkv, hd, _ = cfg
        got_k, got_v = _caches(layers, blocks, block_size, nkv, hd, dtype, layout, gen)
        want_k = [c.clone() for c in got_k]
        want_v = [c.clone() for c in got_v]
        before = [c.clone() for c in got_k]
        torch.ops.vllm_dflash.inject_context_kv(
            kv, w, 1e-6, pos, cos_sin, neox, slots, got_k, got_v
        )
        reference.inject_context_kv(kv, w, 1e-6, pos, cos_sin, neox, slots, want_k, want_v)
        for layer in range(layers):
            # Values are copied, so they must be exact; keys within the dtype's tolerance.
            assert torch.equal(got_v[layer], want_v[layer]), (n, layer)
            torch.testing.assert_close(
                got_k[layer].float(), want_k[layer].float(), atol=TOL[dtype], rtol=TOL[dtype]
            )
        # Rows that were written changed; the padding slot and every other row did not.
        written = torch.zeros(blocks * block_size, dtype=torch.bool)
        written[slots[slots >= 0]] = True
        flat_before = before[0].reshape(blocks * block_size, -1)
        flat_after = got_k[0].reshape(blocks * block_size, -1)
        assert torch.equal(flat_after[~written], flat_before[~written])
        assert not torch.equal(flat_after[written], flat_before[written])


def test_inject_context_kv_rotates_like_the_closed_form():
    """The reference itself, on one row: RoPE by position p turns pair (x_j, x_{j+r/2}) by
    p * theta_j, and the norm leaves the row with unit RMS (times the weight)."""
    hd, p = 8, 5
    row = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0])
    kv = torch.stack([row, row]).view(1, 1, 2, 1, hd)
    cos_sin = _cos_sin(16, hd, torch.float32)
    kc, vc = torch.zeros(1, 4, 1, hd), torch.zeros(1, 4, 1, hd)
    args = (kv, torch.ones(1, hd), 0.0, torch.tensor([p]), cos_sin, True, torch.tensor([2]))
    torch.ops.vllm_dflash.inject_context_kv(*args, [kc], [vc])
    normed = row / row.pow(2).mean().sqrt()
    theta = p / (10000 ** (torch.arange(0, hd, 2) / hd))
    a, b = normed[:4], normed[4:]
    expected = torch.cat([a * theta.cos() - b * theta.sin(), b * theta.cos() + a * theta.sin()])
    torch.testing.assert_close(kc[0, 2, 0], expected)
    assert torch.equal(vc[0, 2, 0], row)
    assert kc[0, [0, 1, 3]].abs().sum() == 0


def test_inject_context_kv_refuses_bad_arguments():
    kv = torch.zeros(2, 1, 2, 1, 8)
    ok = dict(
        w=torch.ones(1, 8),
        pos=torch.zeros(2, dtype=torch.long),
        cs=_cos_sin(4, 8, torch.float32),
        slots=torch.zeros(2, dtype=torch.long),
        caches=[torch.zeros(1, 4, 1, 8)],
    )

    def call(**kw):
        a = ok | kw
        torch.ops.vllm_dflash.inject_context_kv(
            kv, a["w"], 1e-6, a["pos"], a["cs"], True, a["slots"], a["caches"], a["caches"]
        )

    call()
    with pytest.raises(RuntimeError, match="slots must be int64"):
        call(slots=torch.zeros(2, dtype=torch.int32))
    with pytest.raises(RuntimeError, match="k_norm_weight must be"):
        call(w=torch.ones(2, 8))
    with pytest.raises(RuntimeError, match="one key and one value cache per layer"):
        call(caches=[])
    with pytest.raises(RuntimeError, match="caches must be"):
        call(caches=[torch.zeros(1, 4, 2, 8)])


def test_inject_context_kv_schema_declares_its_mutations():
    """torch.library's own check: the schema says which arguments the op writes."""
    gen = torch.Generator().manual_seed(0)
    kv, w, pos, cs, neox, slots, blocks = _inputs(CONFIGS[0], torch.float32, 6, 16, True, gen, True)
    keys, values = _caches(4, blocks, 16, 2, 32, torch.float32, "flash", gen)
    torch.library.opcheck(
        torch.ops.vllm_dflash.inject_context_kv.default,
        (kv, w, 1e-6, pos, cs, neox, slots, keys, values),
        test_utils=("test_schema",),
    )


# (name, query heads, kv heads, head_dim, rotary dim) of drafter attention layers.
QK_CONFIGS = [
    ("embedded", 6, 2, 32, 32),
    ("qwen3-8b-b16", 32, 8, 128, 128),
    ("partial-rotary", 8, 4, 64, 32),
]


@pytest.mark.parametrize("cfg", QK_CONFIGS, ids=[c[0] for c in QK_CONFIGS])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("neox", [True, False], ids=["neox", "interleaved"])
def test_qk_norm_rope_matches_reference(cfg, dtype, neox):
    _, heads, kv_heads, hd, rot = cfg
    gen = torch.Generator().manual_seed(zlib.crc32(f"{cfg[0]}{dtype}{neox}".encode()))
    width = (heads + 2 * kv_heads) * hd
    for n, contiguous in [(1, True), (16, False), (48, True)]:
        if contiguous:
            got = torch.randn(n, width, generator=gen).to(dtype)
        else:  # rows of a wider buffer, as a column slice
            got = torch.randn(n, width + 24, generator=gen).to(dtype)[:, 8 : 8 + width]
        want = got.clone()
        v_before = got[:, (heads + kv_heads) * hd :].clone()
        qw, kw = ((torch.rand(hd, generator=gen) + 0.5).to(dtype) for _ in range(2))
        pos = torch.randint(0, 2048, (n,), generator=gen)
        cos_sin = _cos_sin(2048, rot, dtype)
        args = (qw, kw, 1e-6, pos, cos_sin, neox, heads, kv_heads)
        torch.ops.vllm_dflash.qk_norm_rope(got, *args)
        reference.qk_norm_rope(want, *args)
        torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])
        assert torch.equal(got[:, (heads + kv_heads) * hd :], v_before)  # values untouched
        assert not torch.equal(got[:, :hd], v_before[:, :hd])


def test_qk_norm_rope_refuses_bad_arguments():
    qkv = torch.zeros(2, (2 + 2 * 1) * 8)
    w, pos, cs = torch.ones(8), torch.zeros(2, dtype=torch.long), _cos_sin(4, 8, torch.float32)
    torch.ops.vllm_dflash.qk_norm_rope(qkv, w, w, 1e-6, pos, cs, True, 2, 1)
    with pytest.raises(RuntimeError, match=r"qkv must be \[tokens"):
        torch.ops.vllm_dflash.qk_norm_rope(qkv, w, w, 1e-6, pos, cs, True, 3, 1)
    with pytest.raises(RuntimeError, match="positions must be int64"):
        torch.ops.vllm_dflash.qk_norm_rope(qkv, w, w, 1e-6, pos.int(), cs, True, 2, 1)
    torch.library.opcheck(
        torch.ops.vllm_dflash.qk_norm_rope.default,
        (qkv.clone(), w, w, 1e-6, pos, cs, True, 2, 1),
        test_utils=("test_schema",),
    )
