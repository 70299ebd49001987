"""Builds the optional custom-op extension ``vllm_dflash._C`` (csrc/); everything else about
the package is in pyproject.toml.

The extension compiles against the torch found *at build time*, so install with
``pip install --no-build-isolation`` into an environment that already has torch (``make
install`` does). Without torch, or when the compiler fails, the package installs without the
extension and the proposer uses its PyTorch path (one log line says so at start). CUDA
kernels are added when that torch is a CUDA build and nvcc is found; otherwise only the
CPU kernel is built. ``VLLM_DFLASH_BUILD_OPS=0`` skips the extension.
"""

from __future__ import annotations

import os
import shutil

from setuptools import setup

CPU_SOURCES = [
    "csrc/torch_bindings.cpp",
    "csrc/cpu/inject_context_kv.cpp",
    "csrc/cpu/qk_norm_rope.cpp",
]
CUDA_SOURCES = [
    "csrc/cuda/torch_bindings_cuda.cpp",
    "csrc/cuda/inject_context_kv_kernel.cu",
    "csrc/cuda/qk_norm_rope_kernel.cu",
]


def _say(msg: str) -> None:
    print(f"vllm-dflash: {msg}", flush=True)


def extension_args() -> dict:
    if os.environ.get("VLLM_DFLASH_BUILD_OPS", "1") == "0":
        _say("VLLM_DFLASH_BUILD_OPS=0: building without custom ops")
        return {}
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError:
        _say(
            "torch is not importable at build time: building without custom ops (install "
            "with `pip install --no-build-isolation` next to torch to build them)"
        )
        return {}
    flags = {"cxx": ["-O3"]}  # cpp_extension picks the C++ standard torch needs
    nvcc = cpp_extension.CUDA_HOME and shutil.which(
        os.path.join(cpp_extension.CUDA_HOME, "bin", "nvcc")
    )
    if torch.version.cuda and nvcc:
        _say(f"building CPU and CUDA kernels (torch {torch.__version__}, {nvcc})")
        ext = cpp_extension.CUDAExtension(
            "vllm_dflash._C",
            CPU_SOURCES + CUDA_SOURCES,
            extra_compile_args=flags | {"nvcc": ["-O3"]},
        )
    else:
        why = "a CPU build of torch" if not torch.version.cuda else "no nvcc found"
        _say(f"building the CPU kernel only ({why})")
        ext = cpp_extension.CppExtension("vllm_dflash._C", CPU_SOURCES, extra_compile_args=flags)
    ext.optional = True  # a compiler error leaves the PyTorch path, not a failed install
    build = cpp_extension.BuildExtension.with_options(use_ninja=False)
    return {"ext_modules": [ext], "cmdclass": {"build_ext": build}}


setup(**extension_args())
