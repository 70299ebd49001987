"""vllm-dflash: DFlash block-diffusion speculative decoding for vLLM.

Importing this package never imports vLLM; only ``vllm_dflash.serving`` and
``vllm_dflash.plugin`` touch vLLM internals.
"""

__version__ = "0.1.0"
