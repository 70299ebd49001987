"""Does the per-request speedup metric tell the truth? A benchmark, not a test.

Two ``vllm serve`` processes serve the same target: one with DFlash (our proposer and
metrics), one without speculation. The same prompts go to each, at each concurrency, in
interleaved rounds; vLLM times every request's decode (first to last token,
``--enable-per-request-metrics``). Per round it compares

* the metric: mean of ``vllm_dflash_request_speedup`` over that round's requests
  (``/metrics`` before and after), and
* the measurement: mean per-request decode rate with DFlash / without speculation.

    python -m vllm_dflash.bench.speedup_metric [--target T --draft D] [--concurrency 1,4]
        [--num-prompts 16 --max-tokens 128 --rounds 3 --k 7] [--json out.json]

Defaults to the embedded default and its held-out prompts.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from vllm_dflash import assets
from vllm_dflash.bench.server import Server, serve
from vllm_dflash.observability import names


def _decode_rates(server: Server, prompts: list[str], max_tokens: int, c: int) -> list[float]:
    """Per-request decode rate: tokens after the first over vLLM's per-request decode time
    (``--enable-per-request-metrics``: first to last token, engine clock)."""
    body = {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}

    def one(prompt: str) -> float:
        r = server.post("/v1/completions", {**body, "prompt": prompt})
        return (r["usage"]["completion_tokens"] - 1) / (r["metrics"]["generation_time_ms"] / 1e3)

    with ThreadPoolExecutor(c) as pool:
        return list(pool.map(one, prompts))


def _speedup_totals(server: Server) -> tuple[float, float]:
    return (
        server.metric_sum(names.REQUEST_SPEEDUP + "_sum"),
        server.metric_sum(names.REQUEST_SPEEDUP + "_count"),
    )


def run(args: argparse.Namespace) -> list[dict]:
    lines = Path(args.prompts).read_text().splitlines()[: args.num_prompts]
    prompts = [json.loads(line)["prompt"] for line in lines]
    work = Path(args.workdir or tempfile.mkdtemp(prefix="vllm-dflash-speedup-"))
    spec = {"method": "dflash", "model": str(args.draft), "num_speculative_tokens": args.k}
    extra = ["--enable-per-request-metrics"]
    rows = []
    with (
        serve(
            args.target,
            work / "dflash.log",
            served_name="m",
            speculative_config=spec,
            extra_args=extra,
        ) as sd,
        serve(args.target, work / "none.log", served_name="m", extra_args=extra) as none,
    ):
        for c in args.concurrency:
            # Warm-up: also lets the DFlash engine take its first baseline samples.
            _decode_rates(sd, prompts[: 2 * c], args.max_tokens, c)
            _decode_rates(none, prompts[: 2 * c], args.max_tokens, c)
            rounds = []
            for _ in range(args.rounds):
                s0, n0 = _speedup_totals(sd)
                spec_rates = _decode_rates(sd, prompts, args.max_tokens, c)
                s1, n1 = _speedup_totals(sd)
                none_rates = _decode_rates(none, prompts, args.max_tokens, c)
                metric = (s1 - s0) / (n1 - n0) if n1 > n0 else float("nan")
                measured = statistics.mean(spec_rates) / statistics.mean(none_rates)
                baseline = sd.metric_values(names.BASELINE_STEP_SECONDS)
                rounds.append(
                    {
                        "metric": metric,
                        "measured": measured,
                        "reported": n1 - n0,
                        "none_step_s": 1 / statistics.mean(none_rates),
                        "baseline_step_s": baseline,
                    }
                )
            metric = statistics.median(r["metric"] for r in rounds)
            measured = statistics.median(r["measured"] for r in rounds)
            rows.append(
                {
                    "concurrency": c,
                    "metric_mean_speedup": metric,
                    "measured_speedup": measured,
                    "relative_error": metric / measured - 1,
                    "rounds": rounds,
                }
            )
    return rows


def table(rows: list[dict]) -> str:
    out = [
        "| concurrency | speedup metric (mean) | measured (DFlash / none) | metric error |",
        "|---:|---:|---:|---:|",
    ]
    for r in rows:
        out.append(
            f"| {r['concurrency']} | {r['metric_mean_speedup']:.3f} | "
            f"{r['measured_speedup']:.3f} | {100 * r['relative_error']:+.1f} % |"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=str(assets.TARGET))
    ap.add_argument("--draft", default=str(assets.DRAFTER))
    ap.add_argument("--prompts", default=str(assets.HELDOUT_PROMPTS))
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--k", type=int, default=7)
    ap.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4])
    ap.add_argument("--workdir", type=Path)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    rows = run(args)
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
