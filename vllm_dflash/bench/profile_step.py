"""Where one decode step of our proposer spends its time, on the embedded default:
``python -m vllm_dflash.bench.profile_step [--concurrency 1 16] [--out table.md]``.

One vLLM engine runs in this process (no engine-core subprocess) so that the proposer's
methods can be timed from here. For each concurrency two passes run over the held-out
prompts, greedy, concurrency held constant (``engine_worker._timed_pass``):

1. *wall*: every stage is wrapped in a ``perf_counter`` pair; µs per proposer call.
2. *ops*: the same wrappers open ``torch.profiler`` ranges instead, and every ATen / custom
   op's own CPU time is charged to the innermost stage around it. Host time is the stage's
   wall time less the op time inside it: Python, dispatch, argument checks.

Stages: feature gathering (which rows were accepted), fuse (fc -> hidden_norm), context K/V
(k/v projection -> k_norm -> RoPE -> paged-cache write; its ops are listed one by one),
drafter forward, draft tokens (lm_head and the vocabulary-parallel argmax), the rest of
``propose`` (block inputs, attention metadata), and vLLM's rejection sampler
(verification). ``VLLM_DFLASH_CUSTOM_OPS=0`` profiles the PyTorch path. The op pass covers a
shorter slice of prompts (a full trace is gigabytes).
"""

from __future__ import annotations

import argparse
import os
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

# (stage label, owner, attribute): owner "proposer" / "model" / "sampler".
STAGES = [
    ("propose (total)", "proposer", "propose"),
    ("feature gathering", "proposer", "_verified"),
    ("fuse: fc -> hidden_norm", "model", "combine_hidden_states"),
    ("context K/V injection", "model", "precompute_and_store_context_kv"),
    ("drafter forward", "model", "forward"),
    ("draft tokens (lm_head + argmax)", "model", "get_top_tokens"),
    ("verification (rejection sampler)", "sampler", "forward"),
]


class StageTimer:
    """Wraps methods so each call is timed (wall) or opens a profiler range (ops)."""

    def __init__(self) -> None:
        self.profiling = False
        self.wall: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    def wrap(self, label: str, fn: Callable) -> Callable:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if self.profiling:
                with torch.profiler.record_function(f"stage::{label}"):
                    return fn(*args, **kwargs)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.wall[label] += time.perf_counter() - t0
                self.calls[label] += 1

        return timed

    def reset(self) -> None:
        self.wall.clear()
        self.calls.clear()


def _install(llm: Any, timer: StageTimer) -> None:
    from vllm.v1.sample.rejection_sampler import RejectionSampler

    runner = _model_runner(llm)
    owners = {"proposer": runner.drafter, "model": runner.drafter.model}
    sampler = getattr(runner, "rejection_sampler", None)
    if isinstance(sampler, RejectionSampler):
        owners["sampler"] = sampler
    for label, owner, attr in STAGES:
        obj = owners.get(owner)
        if obj is not None:
            setattr(obj, attr, timer.wrap(label, getattr(obj, attr)))


def _model_runner(llm: Any) -> Any:
    core = llm.llm_engine.engine_core.engine_core  # in-process engine core
    return core.model_executor.driver_worker.worker.model_runner


def _op_times(prof: Any) -> tuple[dict[str, dict[str, float]], int]:
    """Self CPU µs of every op, summed per (innermost stage, op name), and the number of
    proposer calls in the trace."""
    out: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    calls = 0
    for ev in prof.events():
        if ev.name.startswith("stage::"):
            calls += ev.name == f"stage::{STAGES[0][0]}"
            continue
        parent = ev.cpu_parent
        while parent is not None and not parent.name.startswith("stage::"):
            parent = parent.cpu_parent
        if parent is not None:
            out[parent.name.removeprefix("stage::")][ev.name] += ev.self_cpu_time_total
    return out, calls


def profile(concurrencies: list[int], max_tokens: int, num_prompts: int) -> str:
    from vllm import LLM

    from vllm_dflash import assets
    from vllm_dflash.bench.engine_worker import _timed_pass, engine_args
    from vllm_dflash.bench.run import load_prompts

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    prompts = load_prompts(assets.HELDOUT_PROMPTS, assets.TARGET, num_prompts)
    spec = {"method": "dflash", "model": str(assets.DRAFTER), "num_speculative_tokens": 15}
    llm = LLM(
        model=str(assets.TARGET),
        speculative_config=spec,
        **engine_args({"distributed_executor_backend": "uni"}),
    )
    timer = StageTimer()
    _install(llm, timer)
    _timed_pass(llm, prompts[:4], 2, max_tokens)  # warm-up
    sections = []
    for c in concurrencies:
        timer.reset()
        _timed_pass(llm, prompts, c, max_tokens)
        steps = timer.calls[STAGES[0][0]]
        wall = {k: v / max(steps, 1) * 1e6 for k, v in timer.wall.items()}
        # A profiler trace of every op is large: the op pass runs a shorter slice.
        timer.profiling = True
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            _timed_pass(llm, prompts[: max(c, 4)], c, max_tokens // 2)
        timer.profiling = False
        ops, op_steps = _op_times(prof)
        per_step = {s: _per_step(d, op_steps) for s, d in ops.items()}
        sections.append(_table(c, steps, wall, per_step))
    return "\n\n".join(sections)


def _per_step(d: dict[str, float], steps: int) -> dict[str, float]:
    return {k: v / max(steps, 1) for k, v in d.items()}


def _table(c: int, steps: int, wall: dict[str, float], ops: dict[str, dict[str, float]]) -> str:
    lines = [
        f"### concurrency {c} ({steps} proposer calls; µs per call)",
        "",
        "| stage | wall | op time | host time | ops inside (self µs) |",
        "|---|---:|---:|---:|---|",
    ]
    inner = {label for label, _, _ in STAGES[1:] if label in wall}
    for label, _, _ in STAGES:
        if label not in wall:
            continue
        op = sum(ops.get(label, {}).values())
        if label == "propose (total)":  # its own ops exclude the nested stages'
            op += sum(sum(ops.get(s, {}).values()) for s in inner if s != STAGES[-1][0])
        top = sorted(ops.get(label, {}).items(), key=lambda kv: -kv[1])[:6]
        detail = ", ".join(f"{name} {us:.0f}" for name, us in top)
        lines.append(
            f"| {label} | {wall[label]:.0f} | {op:.0f} | {wall[label] - op:.0f} | {detail} |"
        )
    nested = sum(wall[s] for s in inner if s != STAGES[-1][0])
    rest = wall.get("propose (total)", 0.0) - nested
    own = sum(ops.get("propose (total)", {}).values())
    lines.append(
        f"| glue in propose (block inputs, metadata) | {rest:.0f} | {own:.0f} | "
        f"{rest - own:.0f} | |"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m vllm_dflash.bench.profile_step")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--out", type=Path, help="also write the tables to this markdown file")
    args = p.parse_args(argv)
    report = profile(args.concurrency, args.max_tokens, args.num_prompts)
    header = f"VLLM_DFLASH_CUSTOM_OPS={os.environ.get('VLLM_DFLASH_CUSTOM_OPS', '1')}\n\n"
    print(header + report)
    if args.out:
        args.out.write_text(header + report + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
