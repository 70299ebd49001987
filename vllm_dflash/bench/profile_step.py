"""Where one engine step spends its time, speculative and plain side by side, on the
embedded default: ``python -m vllm_dflash.bench.profile_step [--concurrency 1 16]
[--k 7] [--drafts always] [--out table.md]``.

Two vLLM engines run in this process, one after the other (no engine-core subprocess, so
their methods can be timed from here): ours, then no speculation (standing aside for the
plain engine puts vLLM back as it was, and the plugin loads once per process). With
``--drafts always|never``, the adversarial drafters of ``vllm-dflash bench``
(``serving/bench_drafts.py``), our engine's own greedy continuations (K + 1 tokens longer;
greedy speculation is lossless, so they are the target's) are the oracle: ``always``
profiles the step at the acceptance ceiling tau = K + 1. For each concurrency, each engine
runs the held-out prompts, greedy, concurrency held constant (``engine_worker._timed_pass``),
after a warm-up pass at that concurrency:

1. *wall*: every stage is wrapped in a ``perf_counter`` pair; µs per engine step, and per
   committed token.
2. *ops* (ours only): the same wrappers open ``torch.profiler`` ranges instead, and every
   ATen / custom op's own CPU time is charged to the innermost stage around it. Host time
   is the stage's wall time less the op time inside it: Python, dispatch, argument checks.

Stages, nested as they run: the LLM engine's step, which holds the engine core's step
(schedule, with our draft policy; the model runner's ``execute_model``: inputs, then the
target's forward over 1 + K tokens per request; ``sample_tokens``: vLLM's rejection
sampler, then drafting, which is vLLM's input preparation around our ``propose``: feature
gathering, fuse, context K/V, drafter forward, draft tokens; ``update_from_output``, with
our policy's observation), the drafts handed to the scheduler, and the output processing
with every stat logger, ours included (in a server that part runs in the API process,
beside the engine core). ``VLLM_DFLASH_CUSTOM_OPS=0`` profiles the PyTorch path,
``VLLM_DFLASH_DRAFT_POLICY=fixed`` the fixed draft length. The op pass covers a shorter
slice of prompts (a full trace is gigabytes).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

# (stage label, owner, attribute, depth). Owners: "llm_engine", "core" (the engine core),
# "scheduler", "runner" (the model runner), "proposer" (ours), "model" (our drafter).
STAGES = [
    ("LLM engine step (+ output processing, stat loggers)", "llm_engine", "step", 0),
    ("engine core step", "core", "step_fn", 1),
    ("schedule (+ draft policy)", "scheduler", "schedule", 2),
    ("execute_model", "runner", "execute_model", 2),
    ("target forward", "runner", "_model_forward", 3),
    ("sample_tokens", "runner", "sample_tokens", 2),
    ("sampling / verification", "runner", "_sample", 3),
    ("drafting (vLLM prep + propose)", "runner", "propose_draft_token_ids", 3),
    ("propose (ours)", "proposer", "propose", 4),
    ("feature gathering", "proposer", "_verified", 5),
    ("fuse: fc -> hidden_norm", "model", "combine_hidden_states", 5),
    ("context K/V injection", "model", "precompute_and_store_context_kv", 5),
    ("drafter forward", "model", "forward", 5),
    ("draft tokens (lm_head + argmax)", "model", "get_top_tokens", 5),
    # Steps where nobody drafts (serving/idle_steps.py); its fuse and K/V rows are counted
    # in the two rows above as well.
    ("context K/V only (nobody drafts)", "proposer", "context_only", 4),
    ("update_from_output (+ policy)", "scheduler", "update_from_output", 2),
    ("drafts to the scheduler", "core", "post_step", 1),
]
TOP = STAGES[0][0]


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
    core = llm.llm_engine.engine_core.engine_core  # in-process engine core
    runner = core.model_executor.driver_worker.worker.model_runner
    drafter = getattr(runner, "drafter", None)
    owners = {
        "llm_engine": llm.llm_engine,
        "core": core,
        "scheduler": core.scheduler,
        "runner": runner,
    }
    if drafter is not None:
        owners |= {"proposer": drafter, "model": drafter.model}
    for label, owner, attr, _ in STAGES:
        obj = owners.get(owner)
        if obj is not None and hasattr(obj, attr):
            setattr(obj, attr, timer.wrap(label, getattr(obj, attr)))


def _op_times(prof: Any) -> tuple[dict[str, dict[str, float]], int]:
    """Self CPU µs of every op, summed per (innermost stage, op name), and the number of
    engine steps in the trace."""
    out: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    calls = 0
    for ev in prof.events():
        if ev.name.startswith("stage::"):
            calls += ev.name == f"stage::{TOP}"
            continue
        parent = ev.cpu_parent
        while parent is not None and not parent.name.startswith("stage::"):
            parent = parent.cpu_parent
        if parent is not None:
            out[parent.name.removeprefix("stage::")][ev.name] += ev.self_cpu_time_total
    return out, calls


def _engine(spec: dict[str, Any] | None) -> Any:
    from vllm import LLM

    from vllm_dflash import assets
    from vllm_dflash.bench.engine_worker import engine_args

    return LLM(
        model=str(assets.TARGET),
        speculative_config=spec,
        **engine_args({"distributed_executor_backend": "uni"}),
    )


def _close(llm: Any) -> None:
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    cleanup_dist_env_and_memory()


def _passes(llm: Any, prompts, concurrencies, max_tokens: int, ops: bool) -> list[dict]:
    """Per concurrency: µs per engine step of every stage, tokens per step, and (``ops``)
    the op times inside each stage."""
    from vllm_dflash.bench.engine_worker import _timed_pass

    timer = StageTimer()
    _install(llm, timer)
    out = []
    for c in concurrencies:
        # Warm-up at this concurrency, as the bench's: the draft policy measures the costs
        # of a batch size it has not seen, which a server pays once, in its first seconds.
        _timed_pass(llm, prompts[: 2 * c], c, max_tokens)
        timer.reset()
        run = _timed_pass(llm, prompts, c, max_tokens)
        steps = max(timer.calls[TOP], 1)
        row = {
            "steps": steps,
            "tokens_per_step": sum(map(len, run.outputs)) / steps,
            "verifying": run.spec.drafts / steps,  # requests that verified drafts
            "verified": run.spec.draft_tokens / steps,
            "wall": {k: v / steps * 1e6 for k, v in timer.wall.items()},
            "ops": {},
        }
        if ops:  # a profiler trace of every op is large: the op pass runs a shorter slice
            timer.profiling = True
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as p:
                _timed_pass(llm, prompts[: max(c, 4)], c, max_tokens // 2)
            timer.profiling = False
            per_stage, op_steps = _op_times(p)
            row["ops"] = {s: _per_step(d, op_steps) for s, d in per_stage.items()}
        out.append(row)
    return out


def profile(
    concurrencies: list[int], max_tokens: int, num_prompts: int, k: int, drafts: str
) -> str:
    from vllm_dflash import assets
    from vllm_dflash.bench.run import load_prompts
    from vllm_dflash.serving import bench_drafts

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    prompts = load_prompts(assets.HELDOUT_PROMPTS, assets.TARGET, num_prompts)
    # Ours first: standing aside for the plain engine puts vLLM back as it was, and the
    # plugin is loaded once per process.
    ours = _engine({"method": "dflash", "model": str(assets.DRAFTER), "num_speculative_tokens": k})
    if drafts != "drafter":
        # Greedy speculation is lossless: our own pass is the target's continuation.
        from vllm_dflash.bench.engine_worker import _timed_pass

        longer = _timed_pass(ours, prompts, 8, max_tokens + k + 1).outputs
        oracle = Path(tempfile.mkdtemp()) / "oracle.json"
        oracle.write_text(json.dumps([[p, o] for p, o in zip(prompts, longer, strict=True)]))
        os.environ["VLLM_DFLASH_BENCH_DRAFTS"] = drafts
        os.environ["VLLM_DFLASH_BENCH_ORACLE"] = str(oracle)
        bench_drafts.install_if_asked()
    spec_rows = _passes(ours, prompts, concurrencies, max_tokens, ops=True)
    _close(ours)
    plain = _engine(None)
    plain_rows = _passes(plain, prompts, concurrencies, max_tokens, ops=False)
    _close(plain)
    sections = [
        _table(c, s, p, k, drafts)
        for c, s, p in zip(concurrencies, spec_rows, plain_rows, strict=True)
    ]
    return "\n\n".join(sections)


def _per_step(d: dict[str, float], steps: int) -> dict[str, float]:
    return {k: v / max(steps, 1) for k, v in d.items()}


def _children(i: int) -> list[str]:
    depth, out = STAGES[i][3], []
    for label, _, _, d in STAGES[i + 1 :]:
        if d <= depth:
            break
        if d == depth + 1:
            out.append(label)
    return out


def _table(c: int, spec: dict, plain: dict, k: int, drafts: str) -> str:
    sw, pw, ops = spec["wall"], plain["wall"], spec["ops"]
    per_token = sw[TOP] / spec["tokens_per_step"]
    plain_token = pw[TOP] / plain["tokens_per_step"]
    lines = [
        f"### concurrency {c}: K = {k}, drafts: {drafts}",
        "",
        f"Ours: {spec['steps']} steps, {spec['tokens_per_step']:.2f} tokens per step, "
        f"{per_token:.0f} µs per token; per step {spec['verifying']:.2f} requests verified "
        f"{spec['verified']:.2f} drafts. No speculation: {plain['steps']} steps, "
        f"{plain['tokens_per_step']:.2f} tokens per step, {plain_token:.0f} µs per token. "
        f"One speculative step costs {sw[TOP] / pw[TOP]:.2f} plain steps; speedup "
        f"{plain_token / per_token:.2f}x.",
        "",
        "| stage | none µs/step | ours µs/step | ours self µs | self op µs | ops (self µs) |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for i, (label, _, _, depth) in enumerate(STAGES):
        if label not in sw and label not in pw:
            continue
        own = sw.get(label, 0.0) - sum(sw.get(ch, 0.0) for ch in _children(i))
        op = sum(ops.get(label, {}).values())
        top = sorted(ops.get(label, {}).items(), key=lambda kv: -kv[1])[:5]
        detail = ", ".join(f"{name} {us:.0f}" for name, us in top)
        name = "&nbsp;&nbsp;" * depth + label
        none = f"{pw[label]:.0f}" if label in pw else "-"
        lines.append(
            f"| {name} | {none} | {sw.get(label, 0.0):.0f} | {own:.0f} | {op:.0f} | {detail} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m vllm_dflash.bench.profile_step")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--k", type=int, default=15, help="num_speculative_tokens")
    p.add_argument(
        "--drafts",
        choices=["drafter", "always", "never"],
        default="drafter",
        help="the drafter's own drafts, or adversarial ones: always or never accepted",
    )
    p.add_argument("--out", type=Path, help="also write the tables to this markdown file")
    args = p.parse_args(argv)
    report = profile(args.concurrency, args.max_tokens, args.num_prompts, args.k, args.drafts)
    settings = ", ".join(
        f"{v}={os.environ.get(v, d)}"
        for v, d in (("VLLM_DFLASH_CUSTOM_OPS", "1"), ("VLLM_DFLASH_DRAFT_POLICY", "auto"))
    )
    header = f"{settings}\n\n"
    print(header + report)
    if args.out:
        args.out.write_text(header + report + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
