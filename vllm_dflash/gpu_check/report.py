"""gpu-check.json (everything, machine-readable) and gpu-check.md (the same, to read)."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from vllm_dflash.gpu_check.results import PartResult, Table

JSON_NAME = "gpu-check.json"
MD_NAME = "gpu-check.md"


@dataclass
class Report:
    mode: str  # "gpu" or "dry-run"
    started: str
    environment: dict[str, Any]
    extension: dict[str, Any]
    shapes: dict[str, Any]
    parts: list[PartResult] = field(default_factory=list)
    seconds: float = 0.0
    exit_code: int | None = None  # None while running (a report written part by part)
    note: str = ""
    # (b) uses no custom op and runs before (a): a kernel fault in (a) poisons the CUDA
    # context for every later check, and must not take (b)'s numbers with it.
    run_order: str = "b, a, c"
    # Whether this process imported vLLM (it must not: only part (c)'s subprocesses do).
    vllm_in_process: bool | None = None


def _clean(x: Any) -> Any:
    """JSON-safe: non-finite floats become strings, unknown objects their str()."""
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_clean(v) for v in x]
    if isinstance(x, str | int | float | bool) or x is None:
        return x
    return str(x)


def write(report: Report, out: Path) -> tuple[Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    js, md = out / JSON_NAME, out / MD_NAME
    js.write_text(json.dumps(_clean(asdict(report)), indent=2) + "\n")
    md.write_text(markdown(report))
    return js, md


def _cell(v: Any) -> str:
    text = "" if v is None else str(v)
    return text.replace("|", "\\|").replace("\n", " ")


def _table(columns: list[str], rows: list[list[Any]]) -> list[str]:
    lines = ["| " + " | ".join(_cell(c) for c in columns) + " |"]
    lines.append("|" + "|".join("---" for _ in columns) + "|")
    lines += ["| " + " | ".join(_cell(v) for v in row) + " |" for row in rows]
    return lines


def _kv_table(d: dict[str, Any]) -> list[str]:
    return _table(["", ""], [[k, v] for k, v in d.items()])


def _render_table(t: Table) -> list[str]:
    lines = [f"**{t.title}**", "", *_table(t.columns, t.rows)]
    if t.note:
        lines += ["", f"_{t.note}_"]
    return lines + [""]


def _part(p: PartResult) -> list[str]:
    lines = [f"## ({p.key}) {p.title}: {p.status}", ""]
    if p.reason:
        lines += [f"**{p.status}**: {p.reason}", ""]
    if p.info:
        lines += _kv_table(p.info) + [""]
    for t in p.tables:
        lines += _render_table(t)
    if p.checks:
        lines += _table(
            ["check", "status", "s", "detail"],
            [[c.name, c.status, f"{c.seconds:.2f}", c.detail] for c in p.checks],
        )
        lines.append("")
    for n in p.notes:
        lines += [f"> {n}", ""]
    for c in p.checks:
        tail = c.metrics.get("stderr_tail") if c.status == "failed" else None
        if c.traceback or tail:
            lines += [f"<details><summary>{c.name}</summary>", "", "```text"]
            lines += [(c.traceback or tail).rstrip(), "```", "", "</details>", ""]
    return lines


def markdown(report: Report) -> str:
    if report.note:
        verdict = report.note
    elif report.exit_code is None:
        verdict = "incomplete (the run did not finish; parts below are those that did)"
    else:
        verdict = "every part that ran passed" if report.exit_code == 0 else "a part failed"
    ext = report.extension
    lines = [
        "# vllm-dflash GPU check",
        "",
        f"Mode **{report.mode}**, started {report.started}, {report.seconds:.1f} s, "
        f"exit code {report.exit_code}: {verdict}. Parts ran in the order {report.run_order} "
        "((b) uses no custom op, so a kernel fault in (a) cannot spoil it).",
        "",
    ]
    lines += ["## Summary", ""]
    lines += _table(
        ["part", "status", "s", "reason"],
        [[f"({p.key}) {p.title}", p.status, f"{p.seconds:.1f}", p.reason] for p in report.parts],
    )
    env = dict(report.environment)
    packages = env.pop("packages", {})
    env["packages present"] = ", ".join(k for k, v in packages.items() if v) or "none"
    env["packages missing"] = ", ".join(k for k, v in packages.items() if not v) or "none"
    lines += ["", "## Machine", "", *_kv_table(env), ""]
    lines += ["## Custom ops extension (vllm_dflash._C)", ""]
    lines += _kv_table(
        {
            "imported": ext.get("imported"),
            "import error": ext.get("import_error"),
            "path": ext.get("path"),
            **{f"kernels: {op}": ", ".join(d) or "none" for op, d in ext["kernels"].items()},
            "ops.load()": ext.get("ops_load"),
            "ops.kernel_devices()": ext.get("ops_kernel_devices"),
        }
    )
    lines += ["", f"## Shapes: {report.shapes.get('name')}", "", *_kv_table(report.shapes), ""]
    for p in report.parts:
        lines += _part(p)
    return "\n".join(lines).rstrip() + "\n"
