"""The project's pieces the kit runs: the compiled ops it finds, and the drafter config."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from vllm_dflash import ops
from vllm_dflash.config import DrafterConfig
from vllm_dflash.gpu_check.shapes import ShapeSet

OPS = ("inject_context_kv", "qk_norm_rope")
DEVICES = ("CPU", "CUDA")


@dataclass
class Extension:
    """What the kit found of the compiled ops (vllm_dflash._C)."""

    imported: bool
    import_error: str | None
    path: str | None
    # Device types with a registered kernel, per op, after importing vllm_dflash._C.
    kernels: dict[str, list[str]] = field(default_factory=dict)
    # What the serving path sees: ops.load() and ops.kernel_devices().
    ops_load: bool | None = None
    ops_kernel_devices: list[str] | None = None

    def has_kernels(self, device: torch.device) -> bool:
        return self.imported and all(device.type.upper() in self.kernels.get(op, []) for op in OPS)

    def missing_reason(self, device: torch.device) -> str:
        """Why the kernels for ``device`` cannot be checked (for the report)."""
        if not self.imported:
            return (
                f"vllm_dflash._C did not import ({self.import_error}). Build it first: "
                "python setup.py build_ext --inplace"
            )
        have = sorted({d for ds in self.kernels.values() for d in ds})
        return (
            f"vllm_dflash._C has no {device.type.upper()} kernel (kernels: "
            f"{', '.join(have) or 'none'}); for CUDA, build with a CUDA torch and nvcc on PATH "
            "or under CUDA_HOME"
        )


def _has_kernel(op: str, device: str) -> bool:
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key(f"vllm_dflash::{op}", device)
    except RuntimeError:  # the op is not registered at all
        return False


def load_extension() -> Extension:
    """Import vllm_dflash._C (registers torch.ops.vllm_dflash.*) and list its kernels.

    The kit imports the module itself, whatever VLLM_DFLASH_CUSTOM_OPS says: it checks what
    was compiled; ops.load() is recorded beside it as what serving would use."""
    try:
        import vllm_dflash._C as ext

        ext_info = Extension(True, None, getattr(ext, "__file__", None))
    except ImportError as e:
        ext_info = Extension(False, f"{type(e).__name__}: {e}", None)
    ext_info.kernels = {op: [d for d in DEVICES if _has_kernel(op, d)] for op in OPS}
    ext_info.ops_load = ops.load()
    if ext_info.ops_load:
        ext_info.ops_kernel_devices = ops.kernel_devices()
    return ext_info


def drafter_config(shapes: ShapeSet) -> DrafterConfig:
    """The validated drafter config of a shape set."""
    return DrafterConfig.from_dict(shapes.drafter_config_dict())
