"""``vllm-dflash bench --sweep-draft-cost``: step costs against draft length, the analytic
model fitted to them, and its prediction against measured speedups (the paper's Figure 3
analogue, on our engine).

Two engines: ours with the adaptive controller, which each pass forces to one draft length
draft_len, and no speculation. For every concurrency c and draft_len the model runner's own timing
of each pure-decode step (``serving/step_timing.py``) gives

* D(c, draft_len): the drafter's time to draft draft_len tokens per request,
* V(c, draft_len): the rest of the step, i.e. the target verifying 1 + draft_len tokens per
  request, sampling and bookkeeping,
* P(c): the same runner time for a plain decode step (the metrics' baseline steps, taken
  here every 10th step until a batch size has 8 of them, then every 25th),

and vLLM's per-position acceptance counters give tau(draft_len). The analytic model
(``analytic.py``) predicts speedup = tau * P / (D + V); measured speedup is the pass's
tok/s over no speculation's, timed back to back. The engine loop around the runner
(scheduling, output handling), steps that carry a new request's prefill, and the baseline
steps (about 4 % of steps, plain decoding) are in the measurement, not in the model. Finally the
controller (``adaptive/controller.py``) is given the sweep's measurements to show which
draft_len it picks at each concurrency.
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

from tqdm import tqdm

from vllm_dflash.adaptive.controller import AdaptiveSettings, DraftLenController
from vllm_dflash.bench.analytic import speedup
from vllm_dflash.bench.compare_backends import Engine
from vllm_dflash.bench.records import TimedPass

SWEEP_DRAFT_LENS = (1, 2, 3, 4, 6, 8, 12)  # and K
# Baseline (plain) steps for P(c): every 10th step until a batch size has 8, then every 25th.
BASELINE_ENV = {
    "VLLM_DFLASH_BASELINE_EVERY": "25",
    "VLLM_DFLASH_BASELINE_MIN_GAP": "10",
    "VLLM_DFLASH_BASELINE_WARMUP": "0",
}


@dataclass
class SweepRow:
    concurrency: int
    draft_len: int
    drafter_ms: float | None
    verify_ms: float | None
    plain_ms: float | None
    tau: float
    predicted: float | None
    measured: float
    matches_none: bool


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def cumulative_acceptance(runs: list[tuple[int, TimedPass]], k_max: int) -> list[float]:
    """c_k = P(drafts 1..k all accepted), pooled over the passes that drafted position k.
    ``runs``: (draft_len, pass result) pairs."""
    out = []
    for k in range(k_max):
        hits = sum(r.spec.per_pos[k] for g, r in runs if g > k)
        drafts = sum(r.spec.drafts for g, r in runs if g > k)
        out.append(hits / drafts if drafts else 0.0)
    return out


def controller_on_sweep(
    c: int, rows: list[SweepRow], runs: list[tuple[int, TimedPass]]
) -> int | None:
    """The draft_len the adaptive controller picks at concurrency ``c`` given the sweep's
    measurements: its cost tables hold the median drafter and verify times per draft_len, and
    its acceptance estimate (pooled, no forgetting) every verification of the sweep, from vLLM's
    per-position counters (a draft with exactly j accepted tokens is counted
    per_pos[j-1] - per_pos[j] times). None when some draft_len has no pure-decode step at
    batch ``c`` (the controller would then have no cost curve)."""
    draft_lens = [r.draft_len for r in rows]
    pooled = AdaptiveSettings(adaptive=True, adaptive_half_life=10**9)  # like the model
    ctl = DraftLenController(max(draft_lens), pooled, probes=draft_lens)
    for r in rows:
        if r.drafter_ms is not None and r.verify_ms is not None:
            ctl.observe_step(c, r.draft_len, r.drafter_ms / 1e3, r.draft_len, r.verify_ms / 1e3)
    for g, run in runs:
        pos, n = run.spec.per_pos[:g], run.spec.drafts
        at_least = [n, *pos]  # drafts with >= j accepted, j = 0..g
        for j in range(g + 1):
            exactly = at_least[j] - (at_least[j + 1] if j < g else 0)
            for _ in range(exactly):
                ctl.observe_verify(g, j)
    return ctl.best(c) if ctl.costs.complete(c) else None


def analyse(
    passes: dict[tuple[int, int], list[TimedPass]], concurrency: list[int], draft_lens: list[int]
) -> list[SweepRow]:
    """passes[(c, draft_len)]: timed passes; draft_len 0 is no speculation."""
    k_max = max(draft_lens)
    rows = []
    for c in concurrency:
        spec_runs = [(g, r) for g in draft_lens for r in passes[(c, g)]]
        cum = cumulative_acceptance(spec_runs, k_max)
        steps = [s for _, r in spec_runs for s in r.steps or () if s.batch == c]
        plain = _median([s.verify_s for s in steps if s.verified_len == 0])
        none = passes[(c, 0)]
        for g in draft_lens:
            d = _median([s.drafter_s for s in steps if s.drafted_len == g])
            v = _median([s.verify_s for s in steps if s.verified_len == g])
            tau = 1.0 + sum(cum[:g])
            predicted = None
            if d is not None and v is not None and plain is not None:
                predicted = speedup(tau, plain, d, v)
            runs = passes[(c, g)]
            rows.append(
                SweepRow(
                    concurrency=c,
                    draft_len=g,
                    drafter_ms=None if d is None else 1e3 * d,
                    verify_ms=None if v is None else 1e3 * v,
                    plain_ms=None if plain is None else 1e3 * plain,
                    tau=tau,
                    predicted=predicted,
                    measured=statistics.median(
                        r.tokens_per_s / b.tokens_per_s for r, b in zip(runs, none, strict=True)
                    ),
                    matches_none=all(r.outputs == none[0].outputs for r in runs),
                )
            )
    return rows


def markdown(rows: list[SweepRow]) -> str:
    def f(x, fmt):
        return "–" if x is None else format(x, fmt)

    lines = [
        "| concurrency | draft length | drafter ms | verify ms | plain step ms | τ at that length "
        "| predicted | measured | greedy = none |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|:---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.concurrency} | {r.draft_len} | {f(r.drafter_ms, '.2f')} | "
            f"{f(r.verify_ms, '.2f')} | {f(r.plain_ms, '.2f')} | {r.tau:.3f} | "
            f"{f(r.predicted, '.2f')}× | {r.measured:.2f}× | "
            f"{'yes' if r.matches_none else 'NO'} |"
        )
    return "\n".join(lines)


def best_draft_lens(rows: list[SweepRow], choices: dict[int, int | None]) -> str:
    lines = [
        "| concurrency | best draft length, predicted | best, measured | controller's choice |",
        "|---:|---:|---:|---:|",
    ]
    for c, choice in choices.items():
        mine = [r for r in rows if r.concurrency == c]
        pred = max((r for r in mine if r.predicted), key=lambda r: r.predicted, default=None)
        meas = max(mine, key=lambda r: r.measured)
        shown = "–" if choice is None else choice
        lines.append(f"| {c} | {pred.draft_len if pred else '–'} | {meas.draft_len} | {shown} |")
    return "\n".join(lines)


def plot(rows: list[SweepRow], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for i, c in enumerate(dict.fromkeys(r.concurrency for r in rows)):
        mine = [r for r in rows if r.concurrency == c]
        gs = [r.draft_len for r in mine]
        color = f"C{i}"
        axes[0].plot(gs, [r.drafter_ms for r in mine], marker="o", color=color, label=f"c={c}")
        axes[1].plot(gs, [r.verify_ms for r in mine], marker="o", color=color, label=f"c={c}")
        if mine[0].plain_ms is not None:
            axes[1].scatter([0], [mine[0].plain_ms], marker="s", color=color)
        axes[2].plot(gs, [r.measured for r in mine], marker="o", color=color, label=f"c={c}")
        axes[2].plot(gs, [r.predicted for r in mine], linestyle="--", color=color)
    axes[0].set_title("drafter time per step (ms)")
    axes[1].set_title("verify time per step (ms; square: plain step)")
    axes[2].set_title("speedup vs no speculation\n(solid: measured, dashed: model)")
    axes[2].axhline(1.0, color="grey", linewidth=0.8)
    for ax in axes:
        ax.set_xlabel("draft length (draft tokens per step)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def measure(args: argparse.Namespace, prompts, workdir: Path, draft_lens: list[int]):
    engines: list[Engine] = []
    try:
        for label, env in tqdm(
            (("adaptive", BASELINE_ENV), ("none", {})), desc="starting engines", unit="engine"
        ):
            engines.append(Engine(label, args, prompts, workdir, env=env))
        ours, none = engines
        passes: dict[tuple[int, int], list[TimedPass]] = {}
        plan = [
            (r, c, g) for r in range(args.repeats) for c in args.concurrency for g in draft_lens
        ]
        for r, c, g in tqdm(plan, desc="timed passes", unit="pass"):
            # One no-speculation pass per round and concurrency, timed next to the draft_lens.
            if g == (draft_lens[0] if r % 2 == 0 else draft_lens[-1]):
                passes.setdefault((c, 0), []).append(none.run(c))
            passes.setdefault((c, g), []).append(ours.run(c, draft_len=g))
        return passes
    finally:
        for engine in engines:
            engine.close()


def sweep(args: argparse.Namespace, prompts, workdir: Path) -> tuple[list[SweepRow], str]:
    """Measure, analyse; the rows and their tables (``run.py`` prints and writes them)."""
    draft_lens = args.sweep_draft_lens or [*(g for g in SWEEP_DRAFT_LENS if g < args.k), args.k]
    draft_lens = sorted(set(draft_lens))
    passes = measure(args, prompts, workdir, draft_lens)
    (workdir / "sweep_passes.json").write_text(
        json.dumps({f"{c}@{g}": [asdict(r) for r in runs] for (c, g), runs in passes.items()})
    )
    rows = analyse(passes, args.concurrency, draft_lens)
    choices = {
        c: controller_on_sweep(
            c,
            [r for r in rows if r.concurrency == c],
            [(g, r) for g in draft_lens for r in passes[(c, g)]],
        )
        for c in args.concurrency
    }
    return rows, f"{markdown(rows)}\n\n{best_draft_lens(rows, choices)}"
