"""vLLM side of vllm-dflash: the only package that touches vLLM internals.

Import ``vllm_dflash.serving.install`` to swap our proposer and drafter in; the other
modules are loaded by vLLM itself (the drafter model by its registry, the proposer by the
model runner) once that is done.
"""
