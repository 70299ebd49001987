"""Custom ops (csrc/), compiled into the optional extension ``vllm_dflash._C``.

``load()`` imports the extension once per process and logs one line saying which path the
proposer takes: the compiled kernels, or the PyTorch path when the extension was not built
(no compiler or no torch at build time, see setup.py), does not load (built against another
torch), or ``VLLM_DFLASH_CUSTOM_OPS=0`` turns it off. Nothing here imports vLLM.
"""

from __future__ import annotations

import functools
import logging

import torch
from pydantic import Field

from vllm_dflash.env_settings import EnvSettings

# Under vLLM's "vllm" logger so the line appears in vLLM's own log output.
logger = logging.getLogger("vllm.plugins.vllm_dflash")

INJECT_CONTEXT_KV = "vllm_dflash::inject_context_kv"


class CustomOpSettings(EnvSettings):
    custom_ops: bool = Field(
        True, description="1 to use the compiled ops when they are built, 0 for the PyTorch path"
    )


@functools.cache
def load() -> bool:
    """True when the extension is loaded and enabled (its kernels are registered)."""
    if not CustomOpSettings.from_env().custom_ops:
        logger.info("vllm-dflash: custom ops off (VLLM_DFLASH_CUSTOM_OPS=0); PyTorch path")
        return False
    try:
        import vllm_dflash._C  # noqa: F401  (registers torch.ops.vllm_dflash.*)
    except ImportError as e:
        logger.info(
            "vllm-dflash: custom ops not available (%s); using the PyTorch path. Fix: "
            "pip install --no-build-isolation vllm-dflash next to torch and a C++ compiler",
            e,
        )
        return False
    logger.info("vllm-dflash: custom ops loaded (%s)", ", ".join(kernel_devices()))
    return True


def kernel_devices() -> list[str]:
    """Device types with a compiled inject_context_kv kernel in this process."""
    return [
        d
        for d in ("CPU", "CUDA")
        if torch._C._dispatch_has_kernel_for_dispatch_key(INJECT_CONTEXT_KV, d)
    ]


def has_kernel(device: torch.device) -> bool:
    return load() and device.type.upper() in kernel_devices()
