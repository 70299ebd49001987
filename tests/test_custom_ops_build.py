"""Building the extension: a wheel with the CPU kernel on a machine without a CUDA
toolchain, a wheel without the extension when torch is missing at build time (the package
still installs; the PyTorch path serves), and the CUDA sources compiling wherever nvcc is."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _source_tree(tmp: Path) -> Path:
    """The tracked and new files of this checkout, as a fresh clone would have them."""
    files = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    src = tmp / "src"
    for f in files:
        if (ROOT / f).is_file():
            (src / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, src / f)
    return src


def _wheel_names(dist: Path) -> list[str]:
    (wheel,) = dist.glob("*.whl")
    return zipfile.ZipFile(wheel).namelist()


def _without_cuda_env() -> dict[str, str]:
    path = os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep) if "cuda" not in p)
    return os.environ | {"PATH": path, "CUDA_HOME": "/nonexistent", "CUDA_PATH": ""}


def test_wheel_builds_the_cpu_kernel_without_a_cuda_toolchain(tmp_path):
    src = _source_tree(tmp_path)
    out = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-v"]
        + ["-w", str(tmp_path / "dist"), str(src)],
        env=_without_cuda_env(),
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "building the CPU kernel only" in out.stdout + out.stderr
    names = _wheel_names(tmp_path / "dist")
    assert any(n.startswith("vllm_dflash/_C") and n.endswith(".so") for n in names)
    assert "vllm_dflash/assets/code-drafter-b16/config.json" in names


def test_wheel_without_torch_at_build_time_has_no_extension(tmp_path):
    src = _source_tree(tmp_path)
    build = (
        "import sys; sys.modules['torch'] = None\n"  # as in an isolated build environment
        f"sys.argv = ['setup.py', '-q', 'bdist_wheel', '-d', {str(tmp_path / 'dist')!r}]\n"
        "exec(open('setup.py').read())\n"
    )
    out = subprocess.run([sys.executable, "-c", build], cwd=src, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "torch is not importable at build time" in out.stdout
    names = _wheel_names(tmp_path / "dist")
    assert not any(n.startswith("vllm_dflash/_C") for n in names)
    assert "vllm_dflash/ops/__init__.py" in names  # the fallback's loader ships


def _nvcc() -> str | None:
    return shutil.which("nvcc") or next(
        (p for p in ("/usr/local/cuda/bin/nvcc",) if os.access(p, os.X_OK)), None
    )


@pytest.mark.skipif(_nvcc() is None, reason="no CUDA toolchain on this machine")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_cuda_kernels_compile_with_nvcc(tmp_path, arch):
    for cu in sorted((ROOT / "csrc" / "cuda").glob("*.cu")):
        out = subprocess.run(
            [_nvcc(), "-std=c++17", "-O3", f"-arch={arch}", "-c", str(cu)]
            + ["-o", str(tmp_path / f"{cu.stem}.o")],
            capture_output=True,
            text=True,
        )
        assert out.returncode == 0, f"{cu.name}: {out.stderr[-3000:]}"


@pytest.mark.skipif(_nvcc() is None, reason="no CUDA toolchain on this machine")
def test_cuda_torch_bindings_compile_against_torch_headers(tmp_path):
    """The binding needs a CUDA build of torch to link; its source must at least compile
    against torch's headers. A CPU torch lacks one CMake-generated header, which only says
    whether c10_cuda is a shared library: an empty stand-in is enough to compile."""
    include = Path(torch.__file__).parent / "include"
    shim = tmp_path / "shim"
    generated = include / "c10/cuda/impl/cuda_cmake_macros.h"
    if not generated.exists():
        (shim / "c10/cuda/impl").mkdir(parents=True)
        (shim / "c10/cuda/impl/cuda_cmake_macros.h").write_text("#pragma once\n")
    homes = [
        Path(_nvcc()).resolve().parents[1],
        Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")),
    ]
    cuda_include = next(
        h / "include"
        for h in homes + [Path("/usr/local/cuda")]
        if (h / "include/cuda_runtime.h").exists()
    )
    out = subprocess.run(
        ["g++", "-std=c++20", "-fsyntax-only", f"-I{shim}", f"-I{include}"]
        + [f"-I{include / 'torch/csrc/api/include'}", f"-I{cuda_include}"]
        + [f"-I{sysconfig.get_paths()['include']}"]
        + [str(ROOT / "csrc/cuda/torch_bindings_cuda.cpp")],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr[-3000:]
