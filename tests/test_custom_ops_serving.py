"""The fused context-K/V path inside serving: cache views measured from vLLM's own CPU
attention backend, the fused write equal to the PyTorch path's, a layout that is not a
strided view refused, and the fallback chosen (with one log line) when the extension is
absent or turned off."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import types

import pytest
import torch
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

from vllm_dflash.serving.context_kv import ContextKvWriter, paged_views

NKV, HD, BS, BLOCKS, LAYERS = 2, 32, 32, 6, 4


def _cpu_impl() -> CPUAttentionBackendImpl:
    # do_kv_cache_update reads only these two fields of the impl (and the layer's isa and
    # scales); the full constructor needs a model config.
    impl = object.__new__(CPUAttentionBackendImpl)
    impl.attn_type, impl.kv_cache_dtype = AttentionType.DECODER, "auto"
    return impl


def _layer(impl, isa="vec", cache=None):
    cache = torch.randn(BLOCKS, NKV, BS, 2 * HD) if cache is None else cache
    return types.SimpleNamespace(
        impl=impl, kv_cache=cache, isa=isa, _k_scale_float=1.0, _v_scale_float=1.0
    )


@pytest.mark.parametrize("isa", ["vec", "vec16"])
def test_views_of_the_cpu_backend_cache_match_its_own_writes(isa):
    layer = _layer(_cpu_impl(), isa)
    views = paged_views(layer, NKV, HD)
    assert views is not None
    key, value = views
    assert key.shape == value.shape == (BLOCKS, BS, NKV, HD)
    assert key.stride(-1) == BS  # the CPU backend stores key blocks dimension-major
    slots = torch.tensor([0, BS - 1, BS, 3 * BS + 5, BLOCKS * BS - 1])
    k, v = torch.randn(len(slots), NKV, HD), torch.randn(len(slots), NKV, HD)
    expected = layer.kv_cache.clone()
    layer.impl.do_kv_cache_update(layer, k, v, expected, slots)
    key[slots // BS, slots % BS] = k
    value[slots // BS, slots % BS] = v
    assert torch.equal(layer.kv_cache, expected)


class _Scrambled:
    """A backend whose cache is not a strided view: odd slots store their rows reversed."""

    def do_kv_cache_update(self, layer, key, value, kv_cache, slots):
        blocks = kv_cache.view(-1, 2, NKV, HD)
        for i, s in enumerate(slots.tolist()):
            k, v = (key[i], value[i]) if s % 2 == 0 else (key[i].flip(-1), value[i].flip(-1))
            blocks[s, 0], blocks[s, 1] = k, v


def test_a_layout_that_is_not_a_strided_view_is_refused():
    layer = _layer(_Scrambled(), cache=torch.zeros(BLOCKS, BS, 2, NKV, HD))
    assert paged_views(layer, NKV, HD) is None


def _attns(impl, caches):
    with set_current_vllm_config(VllmConfig()):
        rope = get_rope(HD, max_position=2048, rope_parameters={"rope_type": "default"})
    return [
        types.SimpleNamespace(
            attn=_layer(impl, cache=c), rotary_emb=rope, num_kv_heads=NKV, head_dim=HD
        )
        for c in caches
    ]


def test_fused_writer_equals_the_pytorch_path(caplog):
    gen = torch.Generator().manual_seed(1)
    caches = [torch.randn(BLOCKS, NKV, BS, 2 * HD, generator=gen) for _ in range(LAYERS)]
    fused = ContextKvWriter(_attns(_cpu_impl(), caches), torch.rand(LAYERS, HD) + 0.5, 1e-6)
    plain_caches = [c.clone() for c in caches]
    plain = ContextKvWriter(_attns(_cpu_impl(), plain_caches), fused.k_norm_weight, fused.eps)
    n = 40
    kv = torch.randn(n, LAYERS, 2, NKV, HD, generator=gen)
    positions = torch.randint(0, 2048, (n,), generator=gen)
    slots = torch.randperm(BLOCKS * BS, generator=gen)[:n]
    with caplog.at_level(logging.INFO, logger="vllm.plugins.vllm_dflash"):
        fused(kv, positions, slots)
    assert "through the fused inject_context_kv op" in caplog.text
    plain.pytorch_path(kv, positions, slots)
    for a, b in zip(caches, plain_caches, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert not torch.equal(caches[0], plain_caches[0] * 0)


def _load_log(env: dict[str, str], prelude: str = "") -> list[str]:
    code = (
        "import logging, sys\n"
        "logging.basicConfig(level=logging.INFO, format='%(message)s', stream=sys.stdout)\n"
        f"{prelude}\n"
        "from vllm_dflash import ops\n"
        "print('loaded' if ops.load() else 'fallback')\n"
        "ops.load()\n"  # cached: no second line
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=os.environ | env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [line for line in out.splitlines() if line]


def test_the_extension_loads_with_one_line():
    lines = _load_log({"VLLM_DFLASH_CUSTOM_OPS": "1"})
    assert lines[-1] == "loaded"
    assert [line for line in lines if "custom ops" in line] == [
        "vllm-dflash: custom ops loaded (CPU)"
    ]


def test_absent_extension_falls_back_with_one_line():
    # As on a machine where the build had no compiler: importing the extension fails.
    lines = _load_log({}, "sys.modules['vllm_dflash._C'] = None")
    assert lines[-1] == "fallback"
    notes = [line for line in lines if "custom ops" in line]
    assert len(notes) == 1 and "using the PyTorch path" in notes[0]


def test_custom_ops_can_be_turned_off():
    lines = _load_log({"VLLM_DFLASH_CUSTOM_OPS": "0"})
    assert lines[-1] == "fallback"
    assert sum("custom ops off" in line for line in lines) == 1
    with pytest.raises(subprocess.CalledProcessError) as e:
        _load_log({"VLLM_DFLASH_CUSTOM_OPS": "maybe"})
    assert "VLLM_DFLASH_CUSTOM_OPS" in e.value.stderr
