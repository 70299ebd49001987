"""Ours vs vLLM's built-in dflash vs no speculation, on the same prompts, in one run: the
machinery behind ``vllm-dflash bench`` (``bench/run.py``) and ``vllm-dflash demo``.

Each backend is a real vLLM engine in its own process (the plugin switch is per process).
Greedy requests, the same prompts for every backend, a warm-up pass at each concurrency
of the run excluded (where a server is after its first seconds at that load). All engines
are started first; then each round times one pass of every backend back to back
(alternating the order). tok/s is the best of the passes; the ratios ("vs none",
"vs built-in") are medians over rounds of the ratio within a round; TTFT and TPOT
percentiles pool every request of every timed pass.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from vllm_dflash.bench.records import TimedPass
from vllm_dflash.errors import DFlashConfigError, DFlashError

BACKENDS = ("dflash", "builtin", "none")
KINDS = ("dflash", "dflash-fixed", "builtin", "none", "adaptive", "dflash-pytorch")


def parse_backend(label: str) -> tuple[str, int | None]:
    """``kind`` or ``kind:K``: dflash (ours, with its draft policy: each request drafts up
    to K where it pays), dflash-fixed (ours, every request verifies K drafts every step),
    builtin (vLLM's), adaptive (ours, draft length chosen per step, K the most),
    dflash-pytorch (ours without the compiled ops: the before/after of csrc/), none; K
    overrides the run's draft tokens per step."""
    kind, _, k = label.partition(":")
    if kind not in KINDS or (k and (not k.isdigit() or int(k) < 1 or kind == "none")):
        raise DFlashConfigError(
            f"backend {label!r}: write one of {', '.join(KINDS)}, optionally with ':K' "
            "(K >= 1 draft tokens; not for none), e.g. dflash:7"
        )
    return kind, int(k) if k else None


@dataclass
class Row:
    backend: str
    concurrency: int
    tokens_per_s: float
    acceptance_length: float | None
    speedup_vs_none: float
    ratio_vs_builtin: float | None
    matches_none: bool
    draft_tokens_per_step: float | None = None  # mean drafts verified per request and step
    ttft_ms: tuple[float, float, float] | None = None  # p50, p90, p99
    tpot_ms: tuple[float, float, float] | None = None
    drafter_ms: float | None = None  # model-runner time in the proposer per drafting step


def percentiles_ms(values: list[float]) -> tuple[float, float, float] | None:
    """p50, p90, p99 in milliseconds (nearest rank); None without values."""
    if not values:
        return None
    v = sorted(values)
    return tuple(1e3 * v[min(len(v) - 1, int(q * len(v)))] for q in (0.5, 0.9, 0.99))


class EngineFailed(DFlashError):
    """An engine process died (at start or while timing); names its log and last error.
    The CLI prints it as an error and exits 2 (``vllm-dflash bench`` and ``demo``)."""

    def __init__(self, backend: str, code: int | None, log: Path) -> None:
        lines = log.read_text(errors="replace").splitlines() if log.exists() else []
        errors = [x for x in lines if "Error" in x or "error:" in x]
        last = (errors or lines or ["<empty log>"])[-1].strip()
        super().__init__(f"the {backend} engine failed (exit {code}): {last}\n  full log: {log}")


def cpu_binding(ranks: int) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` giving each tensor-parallel rank an equal share of this
    process's cores ("0|1" for two ranks on two cores). Without it vLLM's CPU build binds by
    NUMA node and refuses more ranks than nodes."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < ranks:
        raise DFlashConfigError(
            f"--tensor-parallel-size {ranks} needs at least {ranks} cores for one rank each, "
            f"this process may use {len(cores)}. Fix: lower it, or set "
            "VLLM_CPU_OMP_THREADS_BIND yourself"
        )
    share = len(cores) // ranks
    return "|".join(",".join(map(str, cores[r * share : (r + 1) * share])) for r in range(ranks))


class Engine:
    """A running engine_worker process for one backend."""

    def __init__(
        self,
        backend: str,
        args: argparse.Namespace,
        prompts,
        workdir: Path,
        env: dict[str, str] | None = None,
    ):
        self.backend = backend
        kind, k = parse_backend(backend)
        spec = None
        if kind != "none":
            k = k or args.k
            spec = {"method": "dflash", "model": str(args.draft), "num_speculative_tokens": k}
        tp = getattr(args, "tensor_parallel_size", 1)
        request = {
            "target": str(args.target),
            "speculative_config": spec,
            "prompts": prompts,
            "max_tokens": args.max_tokens,
            "warmup": sorted(set(getattr(args, "concurrency", [2]))),
            # One process runs engine core and model: an idle engine then blocks instead of
            # polling, and does not steal CPU from the backend being timed. Tensor
            # parallelism needs a worker process per rank (vLLM's multiprocessing executor).
            "engine": {"distributed_executor_backend": "uni"}
            if tp == 1
            else {"tensor_parallel_size": tp},
        }
        name = backend.replace(":", "-k")
        req_path = workdir / f"{name}.req.json"
        req_path.write_text(json.dumps(request))
        self.log = workdir / f"{name}.log"
        read, write = os.pipe()
        env = (
            os.environ
            | {
                "VLLM_DFLASH_BACKEND": "builtin" if kind == "builtin" else "dflash",
                "VLLM_DFLASH_ADAPTIVE": "1" if kind == "adaptive" else "0",
                "VLLM_DFLASH_DRAFT_POLICY": "fixed" if kind == "dflash-fixed" else "auto",
                "VLLM_DFLASH_CUSTOM_OPS": "0" if kind == "dflash-pytorch" else "1",
                "VLLM_DFLASH_BENCH_FD": str(write),
                "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            }
            | (env or {})
        )
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        if tp > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in env:  # read by CPU builds only
            env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_binding(tp)
        with self.log.open("w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "vllm_dflash.bench.engine_worker", str(req_path)],
                stdin=subprocess.PIPE,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                pass_fds=(write,),
                text=True,
            )
        os.close(write)
        self.results = os.fdopen(read)
        self._read()  # {"ready": true} once warmed up

    def _read(self) -> dict:
        line = self.results.readline()
        if not line:
            self.proc.wait()
            raise EngineFailed(self.backend, self.proc.returncode, self.log)
        return json.loads(line)

    def run(self, concurrency: int, draft_len: int | None = None) -> TimedPass:
        """One timed pass; ``draft_len`` fixes an adaptive engine's draft length for it."""
        cmd = {"concurrency": concurrency} | ({"draft_len": draft_len} if draft_len else {})
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return TimedPass.from_json(self._read())

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def measure(
    args: argparse.Namespace,
    prompts,
    workdir: Path,
    backends: Sequence[str] = BACKENDS,
    env: dict[str, str] | None = None,
) -> dict[tuple[str, int], list[TimedPass]]:
    """Start every backend, then time them in interleaved rounds: (backend, c) -> passes."""
    engines: list[Engine] = []
    try:
        for backend in tqdm(backends, desc="starting engines", unit="engine"):
            engines.append(Engine(backend, args, prompts, workdir, env))
        passes: dict[tuple[str, int], list[TimedPass]] = {}
        rounds = [(r, c) for r in range(args.repeats) for c in args.concurrency]
        for r, c in tqdm(rounds, desc="timed rounds", unit="round"):
            order = engines if r % 2 == 0 else engines[::-1]  # no backend always goes first
            for engine in order:
                passes.setdefault((engine.backend, c), []).append(engine.run(c))
        return passes
    finally:
        for engine in engines:
            engine.close()


def _paired(runs: list[TimedPass], base: list[TimedPass]) -> float:
    """Median over rounds of the ratio of two backends' passes timed back to back: the
    machine's slow spells hit both sides of a pair, so this is steadier than best-of."""
    return statistics.median(
        r.tokens_per_s / b.tokens_per_s for r, b in zip(runs, base, strict=True)
    )


def _mean_ms(seconds: list[float]) -> float | None:
    return 1e3 * statistics.fmean(seconds) if seconds else None


def compare(
    passes: dict[tuple[str, int], list[TimedPass]],
    concurrency: list[int],
    backends: Sequence[str] = BACKENDS,
) -> list[Row]:
    """One row per (backend, concurrency); ``backends`` must include "none"."""
    rows = []
    for backend in backends:
        for c in concurrency:
            runs, none = passes[(backend, c)], passes[("none", c)]
            spec = runs[0].spec
            rows.append(
                Row(
                    backend=backend,
                    concurrency=c,
                    tokens_per_s=max(r.tokens_per_s for r in runs),
                    acceptance_length=spec.acceptance_length,
                    speedup_vs_none=_paired(runs, none),
                    ratio_vs_builtin=None
                    if backend == "none" or "builtin" not in backends
                    else _paired(runs, passes[("builtin", c)]),
                    matches_none=all(r.outputs == none[0].outputs for r in runs),
                    draft_tokens_per_step=spec.draft_tokens / spec.drafts if spec.drafts else None,
                    ttft_ms=percentiles_ms([t for r in runs for t in r.ttft]),
                    tpot_ms=percentiles_ms([t for r in runs for t in r.tpot]),
                    drafter_ms=_mean_ms([s for r in runs for s in r.drafter_s]),
                )
            )
    return rows


def markdown(rows: list[Row]) -> str:
    def f(x, fmt):
        return "–" if x is None else format(x, fmt)

    def pct(p):
        return "–" if p is None else f"{p[0]:.1f} / {p[1]:.1f}"

    lines = [
        "| backend | concurrency | output tok/s | drafts / step | acceptance length | vs none "
        "| vs built-in | drafter ms / step | TTFT p50 / p90 ms | TPOT p50 / p90 ms "
        "| greedy = none |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|:---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.backend} | {r.concurrency} | {r.tokens_per_s:.1f} | "
            f"{f(r.draft_tokens_per_step, '.2f')} | {f(r.acceptance_length, '.3f')} | "
            f"{r.speedup_vs_none:.2f}× | "
            f"{f(r.ratio_vs_builtin, '.3f')} | {f(r.drafter_ms, '.2f')} | "
            f"{pct(r.ttft_ms)} | {pct(r.tpot_ms)} | "
            f"{'yes' if r.matches_none else 'NO'} |"
        )
    return "\n".join(lines)
