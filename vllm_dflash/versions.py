"""The vLLM releases this package is tested against (both the GPU and the CPU build)."""

SUPPORTED_VLLM_VERSIONS: tuple[str, ...] = ("0.32.0",)
