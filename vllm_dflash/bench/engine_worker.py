"""One vLLM engine in its own process, timing passes over a prompt set on command:
``python -m vllm_dflash.bench.engine_worker request.json``.

The backend (ours / vLLM's built-in dflash / no speculation) is fixed per process by
``VLLM_DFLASH_BACKEND`` and the request's speculative config, which is why every backend
runs in a separate process.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from vllm_dflash.bench.records import SpecCounters, TimedPass
from vllm_dflash.serving.step_timing import ATTR

COUNTERS = {
    "vllm:spec_decode_num_drafts": "drafts",
    "vllm:spec_decode_num_draft_tokens": "draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "accepted",
    "vllm:num_preemptions": "preemptions",
    "vllm:prefix_cache_hits": "prefix_hits",
}


def spec_counters(llm: Any) -> SpecCounters:
    """vLLM's own spec-decode, preemption and prefix-cache counters, summed over labels."""
    out = SpecCounters()
    for m in llm.get_metrics():
        if m.name in COUNTERS:
            name = COUNTERS[m.name]
            setattr(out, name, getattr(out, name) + int(m.value))
        elif m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            vals, acc = list(m.values), out.per_pos
            n = max(len(vals), len(acc))
            out.per_pos = [
                (acc[i] if i < len(acc) else 0) + (vals[i] if i < len(vals) else 0)
                for i in range(n)
            ]
    return out


def engine_args(overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """Settings that run on a small CPU machine; the request may override any of them."""
    return {
        "dtype": "float32",
        "max_model_len": 512,
        "gpu_memory_utilization": 0.3,
        "enforce_eager": True,  # torch.compile adds ~90 s to every start on CPU
        "seed": 0,
        "disable_log_stats": False,  # the spec-decode counters are read back
    } | (overrides or {})


def _timed_pass(llm: Any, prompts: list[list[int]], concurrency: int, max_tokens: int) -> TimedPass:
    """One pass keeping ``concurrency`` requests in flight: each finished request is
    replaced by the next prompt before the next engine step, as a server sees that many
    clients (``vllm bench serve --max-concurrency``; waves that wait for their slowest
    request would charge speculation for its spread in acceptance). Per request, the time to
    first token and the time per output token after it come from vLLM's own timestamps."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    engine = llm.llm_engine
    before = spec_counters(llm)
    outputs: list[list[int]] = [[] for _ in prompts]
    ttft: list[float] = []
    tpot: list[float] = []
    waiting = iter(range(len(prompts)))
    index: dict[str, int] = {}

    def submit() -> None:
        i = next(waiting, None)
        if i is not None:
            (rid,) = llm.enqueue([{"prompt_token_ids": prompts[i]}], params, use_tqdm=False)
            # enqueue returns vLLM's internal id, "<request id>-<random suffix>"; outputs
            # carry the request id.
            index[rid.rsplit("-", 1)[0]] = i

    t0 = time.perf_counter()
    for _ in range(concurrency):
        submit()
    while engine.has_unfinished_requests():
        for o in engine.step():
            if not o.finished:
                continue
            outputs[index.pop(o.request_id)] = list(o.outputs[0].token_ids)
            submit()
            m = o.metrics
            if m is not None and m.first_token_ts > 0:
                ttft.append(m.first_token_latency)
                if m.num_generation_tokens > 1:
                    decode = m.last_token_ts - m.first_token_ts
                    tpot.append(decode / (m.num_generation_tokens - 1))
    seconds = time.perf_counter() - t0
    spec = spec_counters(llm).minus(before)
    return TimedPass(concurrency, seconds, outputs, spec, ttft=ttft, tpot=tpot)


class DrafterTimes:
    """Per engine step, the model runner's time in the proposer: the records our runner
    hooks attach to each step's output (``serving/step_timing.py``; CUDA-event timed on a
    GPU), read as the in-process scheduler takes them. Steps that drafted nothing (plain
    decoding, no speculation) are left out."""

    def __init__(self, llm: Any) -> None:
        self.seconds: list[float] = []
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler
        update = scheduler.update_from_output

        def update_from_output(scheduler_output, model_runner_output):
            for t in getattr(model_runner_output, ATTR, None) or ():
                if t.drafter_s > 0:
                    self.seconds.append(t.drafter_s)
            return update(scheduler_output, model_runner_output)

        scheduler.update_from_output = update_from_output

    def take(self) -> list[float]:
        out, self.seconds = self.seconds, []
        return out


def _controllers() -> list[Any]:
    """The adaptive controllers of this process's engine (one, or none when it is off)."""
    try:
        from vllm_dflash.serving.adaptive_draft_len import LIVE
    except ImportError:
        return []
    return list(LIVE)


def _steered_pass(
    llm: Any,
    prompts,
    concurrency: int,
    max_tokens: int,
    draft_len: int | None,
    drafter: DrafterTimes,
):
    """A timed pass; with ``draft_len``, the adaptive controller drafts exactly that many
    tokens every step, and the pass reports the runner's per-step records."""
    controllers = _controllers()
    drafter.take()
    for c in controllers:
        c.force, c.trace = draft_len, [] if draft_len else None
    run = _timed_pass(llm, prompts, concurrency, max_tokens)
    run.drafter_s = drafter.take()
    for c in controllers:
        if c.trace is not None:
            run.steps = c.trace
        c.force, c.trace = None, None
    return run


def main(path: str) -> None:
    """Start the engine, warm it up, then time one pass per command read from stdin.

    Commands are JSON lines ``{"concurrency": c}`` (``"draft_len": g`` fixes the adaptive
    controller's draft length for the pass: the cost sweep); each result goes back as one JSON line
    on the file descriptor named by ``VLLM_DFLASH_BENCH_FD`` (vLLM logs to stdout). The
    driver interleaves passes of all backends, so machine noise hits them alike."""
    from vllm import LLM

    req = json.loads(Path(path).read_text())
    results = os.fdopen(int(os.environ["VLLM_DFLASH_BENCH_FD"]), "w", buffering=1)
    llm = LLM(
        model=req["target"],
        speculative_config=req.get("speculative_config"),
        **engine_args(req.get("engine")),
    )
    prompts, max_tokens = req["prompts"], req["max_tokens"]
    drafter = DrafterTimes(llm)
    # Warm-up, excluded: a pass at each concurrency the run times, so that every engine
    # starts its timed passes where a server is after its first seconds at that load
    # (the draft policy has measured the step costs of those batch sizes).
    for c in req.get("warmup", [2]):
        _timed_pass(llm, prompts[: max(8, 2 * c)], c, max_tokens)
    results.write(json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        cmd = json.loads(line)
        run = _steered_pass(
            llm, prompts, cmd["concurrency"], max_tokens, cmd.get("draft_len"), drafter
        )
        results.write(run.to_json() + "\n")


if __name__ == "__main__":
    main(sys.argv[1])
