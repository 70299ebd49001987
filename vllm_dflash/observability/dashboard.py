"""The Grafana dashboard, generated with grafana-foundation-sdk (``pip install
'vllm-dflash[dev]'``). The JSON it writes is committed under ``grafana/`` and a test
checks that it is up to date:

    python -m vllm_dflash.observability.dashboard            # rewrite grafana/...json
    python -m vllm_dflash.observability.dashboard --check    # exit 1 when it is stale

Every query filters on the ``model_name`` and ``instance`` template variables. The
end-to-end test evaluates each of them against a real Prometheus (``queries()``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from vllm_dflash.observability import names as n

OUT = Path(__file__).resolve().parents[2] / "grafana" / "dflash-dashboard.json"
UID = "vllm-dflash"
SEL = '{model_name=~"$model_name", instance=~"$instance"}'
RATE = "[$__rate_interval]"
DS_VAR = "datasource"


def _rate(metric: str, by: str = "") -> str:
    grouped = f" by ({by})" if by else ""
    return f"sum{grouped}(rate({metric}{SEL}{RATE}))"


def _quantile(q: float, hist: str) -> str:
    return f"histogram_quantile({q}, {_rate(hist + '_bucket', 'le')})"


def _mean(hist: str) -> str:
    return f"{_rate(hist + '_sum')} / {_rate(hist + '_count')}"


def _share(part: str, other: str) -> str:
    """Share of ``part``'s seconds in the seconds of both histograms."""
    a, b = _rate(part + "_sum"), _rate(other + "_sum")
    return f"{a} / ({a} + {b})"


# (title, description, panel kind, unit, [(legend, expr)]) in display order, two per row.
PANELS: list[tuple[str, str, str, str, list[tuple[str, str]]]] = [
    (
        "Acceptance length per request",
        "Tokens emitted per verify step, per finished request: p50, p90 and mean. "
        "A sudden drop means the drafter no longer matches the target (wrong layer "
        "offset, replaced LM head, upgrade).",
        "timeseries",
        "none",
        [
            ("p50", _quantile(0.5, n.REQUEST_ACCEPTANCE_LENGTH)),
            ("p90", _quantile(0.9, n.REQUEST_ACCEPTANCE_LENGTH)),
            ("mean", _mean(n.REQUEST_ACCEPTANCE_LENGTH)),
            ("alert floor", f"max(max_over_time({n.ACCEPTANCE_LENGTH_FLOOR}{SEL}{RATE}))"),
        ],
    ),
    (
        "Acceptance by draft position",
        "Share of verify steps whose draft token at position k was accepted (vLLM's "
        "per-position counter over all drafts), over the dashboard's time range.",
        "bargauge",
        "percentunit",
        [
            (
                "{{position}}",
                f"sum by (position) (increase({n.VLLM_ACCEPTED_PER_POS}{SEL}[$__range])) "
                f"/ scalar(sum(increase({n.VLLM_DRAFTS}{SEL}[$__range])))",
            )
        ],
    ),
    (
        "Speedup per request (distribution)",
        "Finished requests per speedup bucket: decode rate over the measured "
        "no-speculation rate of the same engine at the same batch size.",
        "heatmap",
        "none",
        [("{{le}}", f"sum by (le) (increase({n.REQUEST_SPEEDUP}_bucket{SEL}{RATE}))")],
    ),
    (
        "Median speedup",
        "Median per-request speedup; below 1 speculation costs more than it saves.",
        "timeseries",
        "none",
        [("median", _quantile(0.5, n.REQUEST_SPEEDUP)), ("mean", _mean(n.REQUEST_SPEEDUP))],
    ),
    (
        "Output tokens/s",
        "Generated tokens per second (vLLM's counter).",
        "timeseries",
        "none",
        [("output tok/s", _rate(n.VLLM_GENERATION_TOKENS))],
    ),
    (
        "Drafter vs verify time",
        "Share of the model runner's step time spent in the drafter and in the rest "
        "(target forward and verification).",
        "timeseries",
        "percentunit",
        [
            ("drafter", _share(n.DRAFTER_STEP_SECONDS, n.VERIFY_STEP_SECONDS)),
            ("verify", _share(n.VERIFY_STEP_SECONDS, n.DRAFTER_STEP_SECONDS)),
        ],
    ),
    (
        "Draft tokens per step",
        "Draft tokens verified per request and step (vLLM's counters): the configured "
        "num_speculative_tokens, or with VLLM_DFLASH_ADAPTIVE=1 the lengths the adaptive "
        "controller chose (docs/adaptive-draft-length.md), against requests running.",
        "timeseries",
        "none",
        [
            ("draft tokens / step", f"{_rate(n.VLLM_DRAFT_TOKENS)} / {_rate(n.VLLM_DRAFTS)}"),
            ("requests running", f"sum({n.VLLM_RUNNING}{SEL})"),
        ],
    ),
    (
        "Requests running / waiting",
        "vLLM's scheduler gauges.",
        "timeseries",
        "none",
        [("running", f"sum({n.VLLM_RUNNING}{SEL})"), ("waiting", f"sum({n.VLLM_WAITING}{SEL})")],
    ),
    (
        "Drafter and verify step time",
        "Mean model-runner seconds per engine step in the drafter and outside it, and the "
        "measured no-speculation step time (baseline) per batch size.",
        "timeseries",
        "s",
        [
            ("drafter", _mean(n.DRAFTER_STEP_SECONDS)),
            ("verify", _mean(n.VERIFY_STEP_SECONDS)),
            (
                "baseline, batch {{batch_size}}",
                f"max by (batch_size) ({n.BASELINE_STEP_SECONDS}{SEL})",
            ),
        ],
    ),
]

# Template variables: name -> label_values() query (Grafana's Prometheus helper).
VARIABLES = {
    "model_name": f"label_values({n.REQUEST_ACCEPTANCE_LENGTH}_count, model_name)",
    "instance": (
        f'label_values({n.REQUEST_ACCEPTANCE_LENGTH}_count{{model_name=~"$model_name"}}, instance)'
    ),
}


def queries() -> list[tuple[str, str]]:
    """(panel title, PromQL expression) for every query in the dashboard."""
    return [(title, expr) for title, _, _, _, targets in PANELS for _, expr in targets]


def build() -> dict:
    from grafana_foundation_sdk.builders import (
        bargauge,
        dashboard,
        heatmap,
        prometheus,
        timeseries,
    )
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.models.dashboard import DataSourceRef, VariableRefresh

    ds = DataSourceRef(type_val="prometheus", uid="${" + DS_VAR + "}")
    d = (
        dashboard.Dashboard("vLLM DFlash speculative decoding")
        .uid(UID)
        .tags(["vllm", "dflash", "speculative-decoding"])
        .description("Acceptance length, speedup and cost of DFlash in vLLM (vllm-dflash).")
        .refresh("30s")
        .time("now-1h", "now")
        .with_variable(dashboard.DatasourceVariable(DS_VAR).label("Prometheus").type("prometheus"))
    )
    for var, query in VARIABLES.items():
        d = d.with_variable(
            dashboard.QueryVariable(var)
            .label(var)
            .datasource(ds)
            .query(query)
            .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
            .multi(True)
            .include_all(True)
            .all_value(".*")
        )
    kinds = {"timeseries": timeseries, "bargauge": bargauge, "heatmap": heatmap}
    for title, desc, kind, unit, targets in PANELS:
        panel = (
            kinds[kind]
            .Panel()
            .title(title)
            .description(desc)
            .datasource(ds)
            .unit(unit)
            .height(8)
            .span(12)
        )
        for j, (legend, expr) in enumerate(targets):
            q = prometheus.Dataquery().expr(expr).legend_format(legend).ref_id("ABCDEFGH"[j])
            if kind == "bargauge":
                q = q.instant()
            elif kind == "heatmap":
                q = q.format("heatmap")  # type: ignore[arg-type]
            panel = panel.with_target(q)
        if kind == "bargauge":
            panel = panel.min(0).max(1)
        d = d.with_panel(panel)
    return _drop_nulls(json.loads(json.dumps(d.build(), cls=JSONEncoder, sort_keys=True)))


def _drop_nulls(x):
    """Unset fields come out as null (e.g. panel "options"); Grafana wants them absent."""
    if isinstance(x, dict):
        return {k: _drop_nulls(v) for k, v in x.items() if v is not None}
    if isinstance(x, list):
        return [_drop_nulls(v) for v in x]
    return x


def render() -> str:
    return json.dumps(build(), indent=2, sort_keys=True) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--check", action="store_true", help="fail if --out is not up to date")
    args = ap.parse_args(argv)
    text = render()
    if args.check:
        if not args.out.exists() or args.out.read_text() != text:
            print(f"{args.out} is stale. Fix: python -m {__spec__.name}", file=sys.stderr)
            return 1
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
