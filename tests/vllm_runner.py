"""Run one real vLLM engine in its own process: ``python tests/vllm_runner.py request.json``.

The request names the target, an optional speculative config, token-id prompts and sampling;
the outputs are written to the request's "out" path as JSON. Engine tests start this as a
subprocess (one engine per test module) because vLLM spawns its engine core and must run
from a real ``__main__``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(path: str) -> None:
    from vllm import LLM, SamplingParams

    req = json.loads(Path(path).read_text())
    llm = LLM(
        model=req["target"],
        speculative_config=req.get("speculative_config"),
        dtype="float32",
        max_model_len=512,
        gpu_memory_utilization=0.3,
        enforce_eager=True,  # torch.compile would add ~90 s to every start on CPU
        seed=0,
    )
    params = SamplingParams(
        max_tokens=req["max_tokens"], temperature=req.get("temperature", 0.0), ignore_eos=True
    )
    outs = llm.generate([{"prompt_token_ids": p} for p in req["prompts"]], params)
    result = {"outputs": [list(o.outputs[0].token_ids) for o in outs]}
    Path(req["out"]).write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1])
