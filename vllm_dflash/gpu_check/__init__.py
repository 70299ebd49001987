"""A one-shot GPU check kit: ``vllm-dflash gpu-check`` (or ``python -m vllm_dflash.gpu_check``).

(a) the custom ops' CUDA kernels against vllm_dflash/ops/reference.py, eager and in a CUDA
graph, with their cost; (b) the reference drafter's step time at Qwen3-8B-DFlash-b16 shapes,
eager and as a CUDA graph; (c) whether vLLM can run on the machine. Needs the package's own
dependencies, not vLLM or a network; ``--dry-run`` runs the same code at tiny shapes on CPU
for CI.
See run.py for the command and its exit code.
"""
