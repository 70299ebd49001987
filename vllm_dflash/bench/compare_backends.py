"""Ours vs vLLM's built-in dflash vs no speculation, on the same prompts, in one run.

    python -m vllm_dflash.bench.compare_backends [--target T --draft D] \\
        --concurrency 1,4,16 --num-prompts 16 --max-tokens 64 [--json out.json]

Each backend is a real vLLM engine in its own process (the plugin switch is per process).
Greedy requests, the same prompts for every backend, a warm-up pass excluded. All engines
are started first; then each round times one pass of every backend back to back
(alternating the order). tok/s is the best of ``--repeats`` passes; the ratios ("vs none",
"vs built-in") are medians over rounds of the ratio within a round.
Without --target/--draft, a tiny random target is built and a drafter is distilled on its
outputs for the benchmark prompts (vllm_dflash/testing/distill.py), so it is often right.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from tqdm import tqdm

BACKENDS = ("dflash", "builtin", "none")


@dataclass
class Row:
    backend: str
    concurrency: int
    tokens_per_s: float
    acceptance_length: float | None
    speedup_vs_none: float
    ratio_vs_builtin: float | None
    matches_none: bool


def random_prompts(vocab: int, n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, vocab - 1) for _ in range(rng.randint(16, 64))] for _ in range(n)]


class Engine:
    """A running engine_worker process for one backend."""

    def __init__(self, backend: str, args: argparse.Namespace, prompts, workdir: Path):
        self.backend = backend
        spec = None
        if backend != "none":
            spec = {"method": "dflash", "model": str(args.draft), "num_speculative_tokens": args.k}
        request = {
            "target": str(args.target),
            "speculative_config": spec,
            "prompts": prompts,
            "max_tokens": args.max_tokens,
            # One process runs engine core and model: an idle engine then blocks instead of
            # polling, and does not steal CPU from the backend being timed.
            "engine": {"distributed_executor_backend": "uni"},
        }
        req_path = workdir / f"{backend}.req.json"
        req_path.write_text(json.dumps(request))
        self.log = workdir / f"{backend}.log"
        read, write = os.pipe()
        env = os.environ | {
            "VLLM_DFLASH_BACKEND": "builtin" if backend == "builtin" else "dflash",
            "VLLM_DFLASH_BENCH_FD": str(write),
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        }
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
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
            raise SystemExit(
                f"{self.backend} engine failed (exit {self.proc.returncode}); see {self.log}"
            )
        return json.loads(line)

    def run(self, concurrency: int) -> dict:
        self.proc.stdin.write(json.dumps({"concurrency": concurrency}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def measure(
    args: argparse.Namespace, prompts, workdir: Path, backends: Sequence[str] = BACKENDS
) -> dict[tuple[str, int], list]:
    """Start every backend, then time them in interleaved rounds: (backend, c) -> passes."""
    engines: list[Engine] = []
    try:
        for backend in tqdm(backends, desc="starting engines", unit="engine"):
            engines.append(Engine(backend, args, prompts, workdir))
        passes: dict[tuple[str, int], list[dict]] = {}
        rounds = [(r, c) for r in range(args.repeats) for c in args.concurrency]
        for r, c in tqdm(rounds, desc="timed rounds", unit="round"):
            order = engines if r % 2 == 0 else engines[::-1]  # no backend always goes first
            for engine in order:
                passes.setdefault((engine.backend, c), []).append(engine.run(c))
        return passes
    finally:
        for engine in engines:
            engine.close()


def _tps(run: dict) -> float:
    return sum(map(len, run["outputs"])) / run["seconds"]


def _paired(runs: list[dict], base: list[dict]) -> float:
    """Median over rounds of the ratio of two backends' passes timed back to back: the
    machine's slow spells hit both sides of a pair, so this is steadier than best-of."""
    return statistics.median(_tps(r) / _tps(b) for r, b in zip(runs, base, strict=True))


def compare(
    passes: dict[tuple[str, int], list[dict]],
    concurrency: list[int],
    backends: Sequence[str] = BACKENDS,
) -> list[Row]:
    """One row per (backend, concurrency); ``backends`` must include "none"."""
    rows = []
    for backend in backends:
        for c in concurrency:
            runs, none = passes[(backend, c)], passes[("none", c)]
            spec = runs[0]["spec"]
            rows.append(
                Row(
                    backend=backend,
                    concurrency=c,
                    tokens_per_s=max(map(_tps, runs)),
                    acceptance_length=1 + spec["accepted"] / spec["drafts"]
                    if spec["drafts"]
                    else None,
                    speedup_vs_none=_paired(runs, none),
                    ratio_vs_builtin=None
                    if backend == "none" or "builtin" not in backends
                    else _paired(runs, passes[("builtin", c)]),
                    matches_none=all(r["outputs"] == none[0]["outputs"] for r in runs),
                )
            )
    return rows


def markdown(rows: list[Row]) -> str:
    def f(x, fmt):
        return "–" if x is None else format(x, fmt)

    lines = [
        "| backend | concurrency | output tok/s | acceptance length | vs none | vs built-in "
        "| greedy = none |",
        "|---|---:|---:|---:|---:|---:|:---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.backend} | {r.concurrency} | {r.tokens_per_s:.1f} | "
            f"{f(r.acceptance_length, '.3f')} | {r.speedup_vs_none:.2f}× | "
            f"{f(r.ratio_vs_builtin, '.3f')} | {'yes' if r.matches_none else 'NO'} |"
        )
    return "\n".join(lines)


def _distilled_drafter(args: argparse.Namespace, prompts, workdir: Path) -> Path:
    """A tiny drafter distilled on the target's own outputs for these prompts: often right,
    so the table shows real acceptance (the trained embedded default is not shipped yet)."""
    from vllm_dflash.reference.target import HFTarget
    from vllm_dflash.testing.distill import distill
    from vllm_dflash.testing.factory import make_drafter

    random_drafter = make_drafter(workdir / "draft-random", args.target, block_size=args.k + 1)
    print("distilling the tiny drafter on the benchmark prompts ...", file=sys.stderr)
    target = HFTarget.from_pretrained(args.target)
    return distill(
        target, random_drafter, workdir / "draft", prompts, new_tokens=args.max_tokens, steps=600
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--target", type=Path, help="target model dir (default: a tiny random one)")
    p.add_argument("--draft", type=Path, help="DFlash drafter dir (default: a tiny random one)")
    p.add_argument("--k", "--num-speculative-tokens", type=int, default=7, dest="k")
    p.add_argument("--concurrency", default="1,4,16", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="write rows as JSON here")
    p.add_argument("--workdir", type=Path, help="logs and engine outputs (default: a temp dir)")
    args = p.parse_args(argv)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="vllm-dflash-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    if (args.target is None) != (args.draft is None):
        p.error("give both --target and --draft, or neither")
    built = args.target is None
    if built:
        from vllm_dflash.testing.factory import make_target

        args.target = make_target(workdir / "target")
    vocab = json.loads((args.target / "config.json").read_text())["vocab_size"]
    prompts = random_prompts(vocab, args.num_prompts, args.seed)
    if built:
        args.draft = _distilled_drafter(args, prompts, workdir)
    passes = measure(args, prompts, workdir)
    seconds = {f"{b}@{c}": [r["seconds"] for r in runs] for (b, c), runs in passes.items()}
    (workdir / "pass_seconds.json").write_text(json.dumps(seconds, indent=1))
    rows = compare(passes, args.concurrency)
    print(markdown(rows))
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=2))
    return 0 if all(r.matches_none for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
