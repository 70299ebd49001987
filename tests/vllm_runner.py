"""Run one real vLLM engine in its own process: ``python tests/vllm_runner.py request.json``.

The request names the target, an optional speculative config, extra engine arguments and a
list of jobs; each job's outputs and the spec-decode counters it moved are written to the
request's "out" path as JSON. Engine tests start this as a subprocess (one engine per test
module) because vLLM spawns its engine core and must run from a real ``__main__``.

With ``"plugin_stat_loggers": true`` the engine also runs the stat-logger plugins (ours),
and the output holds our ``vllm_dflash_*`` metrics as the engine ends.

Job fields: name, prompts (token-id lists), max_tokens (int or one per prompt),
temperature, top_k, top_p, seed, stop (strings), logprobs (top-n per position, returned
as "top"), concurrency (prompts submitted together;
default all), abort_after_steps + abort (indices of prompts to abort after that many steps).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

from vllm_dflash.bench.engine_worker import engine_args, spec_counters


def run_job(llm: Any, job: dict[str, Any]) -> dict[str, Any]:
    from vllm import SamplingParams

    prompts = job["prompts"]
    max_tokens = job["max_tokens"]
    if isinstance(max_tokens, int):
        max_tokens = [max_tokens] * len(prompts)

    def params(i: int) -> SamplingParams:
        if "seeds" in job:  # one seed per prompt
            seed = job["seeds"][i]
        else:  # a base seed, or none
            seed = None if job.get("seed") is None else job["seed"] + i
        allowed = job.get("allowed_token_ids")  # per prompt: a list of token ids, or None
        return SamplingParams(
            max_tokens=max_tokens[i],
            temperature=job.get("temperature", 0.0),
            top_k=job.get("top_k", 0),
            top_p=job.get("top_p", 1.0),
            seed=seed,
            allowed_token_ids=None if allowed is None else allowed[i],
            stop=job.get("stop"),
            logprobs=job.get("logprobs"),
            ignore_eos=True,
        )

    before = spec_counters(llm)
    if "abort" in job:
        results = _run_with_aborts(llm, prompts, params, job)
    else:
        c = job.get("concurrency") or len(prompts)
        results = []
        for s in range(0, len(prompts), c):
            chunk = range(s, min(s + c, len(prompts)))
            outs = llm.generate(
                [{"prompt_token_ids": prompts[i]} for i in chunk],
                [params(i) for i in chunk],
                use_tqdm=False,
            )
            results += [_result(o) for o in outs]
    return {"results": results, "spec": dataclasses.asdict(spec_counters(llm).minus(before))}


def _result(out: Any) -> dict[str, Any]:
    o = out.outputs[0]
    r = {"tokens": list(o.token_ids), "text": o.text, "finish_reason": o.finish_reason}
    if o.logprobs is not None:  # per position: [token, logprob] pairs, most likely first
        r["top"] = [
            sorted(([t, lp.logprob] for t, lp in pos.items()), key=lambda x: -x[1])
            for pos in o.logprobs
        ]
    return r


def _run_with_aborts(llm: Any, prompts, params, job) -> list[dict[str, Any] | None]:
    engine = llm.llm_engine
    ids = [f"{job['name']}-{i}" for i in range(len(prompts))]
    for i, rid in enumerate(ids):
        engine.add_request(rid, {"prompt_token_ids": prompts[i]}, params(i))
    done: dict[str, Any] = {}
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = _result(out)
        steps += 1
        if steps == job["abort_after_steps"]:
            engine.abort_request([ids[i] for i in job["abort"]])
    return [done.get(rid) for rid in ids]


def main(path: str) -> None:
    from vllm import LLM

    req = json.loads(Path(path).read_text())
    if req.get("plugin_stat_loggers"):
        _with_plugin_stat_loggers()
    llm = LLM(
        model=req["target"],
        speculative_config=req.get("speculative_config"),
        **engine_args(req.get("engine")),
    )
    jobs = {job["name"]: run_job(llm, job) for job in req["jobs"]}
    Path(req["out"]).write_text(json.dumps({"jobs": jobs, "metrics": _our_metrics()}))


def _with_plugin_stat_loggers() -> None:
    """Give the offline engine the stat-logger plugins (ours) as ``vllm serve``'s AsyncLLM
    does; vLLM's ``LLM`` class loads none."""
    from vllm.v1.engine.llm_engine import LLMEngine
    from vllm.v1.metrics.loggers import load_stat_logger_plugin_factories

    build = LLMEngine.from_engine_args.__func__

    def from_engine_args(cls, engine_args, *args, **kwargs):
        kwargs["stat_loggers"] = load_stat_logger_plugin_factories()
        return build(cls, engine_args, *args, **kwargs)

    LLMEngine.from_engine_args = classmethod(from_engine_args)


def _our_metrics() -> dict[str, float]:
    """Our counters and gauges (``vllm_dflash_*`` samples of this process's Prometheus
    registry; vLLM's ``get_metrics`` lists only its own) as the engine ends, summed over
    labels."""
    import prometheus_client

    out: dict[str, float] = {}
    for metric in prometheus_client.REGISTRY.collect():
        if metric.type not in ("counter", "gauge"):
            continue
        for s in metric.samples:
            if s.name.startswith("vllm_dflash_") and not s.name.endswith("_created"):
                out[s.name] = out.get(s.name, 0.0) + float(s.value)
    return out


if __name__ == "__main__":
    main(sys.argv[1])
