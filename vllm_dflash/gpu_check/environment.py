"""The machine the kit ran on: Python, torch, CUDA, the GPU, the compiler, the packages that
decide which code paths served. Every probe is guarded: a missing tool is a value, not an
error."""

from __future__ import annotations

import importlib.util
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from vllm_dflash import __version__

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("pydantic", "numpy", "transformers", "tokenizers", "safetensors", "vllm")


def _run(cmd: list[str], timeout: float = 15.0) -> str | None:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _nvcc() -> dict[str, Any]:
    from torch.utils import cpp_extension

    home = cpp_extension.CUDA_HOME
    path = shutil.which(os.path.join(home, "bin", "nvcc")) if home else None
    path = path or shutil.which("nvcc")
    version = _run([path, "--version"]) if path else None
    return {
        "cuda_home": home,
        "nvcc": path,
        "nvcc_version": version.splitlines()[-1] if version else None,
    }


def _gpu() -> dict[str, Any]:
    if not torch.cuda.is_available():
        return {"cuda_available": False}
    props = torch.cuda.get_device_properties(0)
    smi = _run(
        ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"]
    )
    return {
        "cuda_available": True,
        "gpu_count": torch.cuda.device_count(),
        "gpu_name": props.name,
        "gpu_capability": f"{props.major}.{props.minor}",
        "gpu_multiprocessors": props.multi_processor_count,
        "gpu_memory_gib": round(props.total_memory / 2**30, 1),
        "nvidia_smi": smi,
    }


def _present(name: str) -> bool:
    """Whether ``name`` is installed; find_spec looks without importing (so vLLM stays out of
    this process)."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def collect() -> dict[str, Any]:
    env: dict[str, Any] = {
        "python": sys.version.split()[0],
        "executable": sys.executable,
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "vllm_dflash": __version__,
        "git_commit": _run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"]),
        "packages": {name: _present(name) for name in PACKAGES},
        "VLLM_DFLASH_CUSTOM_OPS": os.environ.get("VLLM_DFLASH_CUSTOM_OPS"),
        "TORCH_CUDA_ARCH_LIST": os.environ.get("TORCH_CUDA_ARCH_LIST"),
    }
    for probe in (_gpu, _nvcc):
        try:
            env.update(probe())
        except Exception as e:  # noqa: BLE001  (describe the machine as far as it goes)
            env[f"{probe.__name__.strip('_')}_error"] = f"{type(e).__name__}: {e}"
    return env
