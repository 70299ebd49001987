"""``vllm-dflash gpu-check [--out DIR] [--dry-run] [--vllm-sources DIR] [--budget-s S]``

Checks the custom ops' CUDA kernels against the PyTorch reference, eager and inside a CUDA
graph (a), times the reference drafter's step at Qwen3-8B-DFlash-b16 shapes, eager and as a
CUDA graph (b), and probes whether vLLM can run here (c). Writes gpu-check.json and
gpu-check.md into --out after every part. Build the extension first
(``python setup.py build_ext --inplace``); the kit does not build it. ``--dry-run`` runs the
same code at tiny shapes on CPU (CPU kernels, eager only, no engine), for CI. Exit code 0
when every part that ran passed, 1 when any failed (the report is written either way).
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path

import torch

from vllm_dflash.gpu_check import drafter_timing, engine_probe, environment, ops_check, project
from vllm_dflash.gpu_check.args import WATCHDOG_GRACE_S, add_arguments
from vllm_dflash.gpu_check.plan import Plan, make_plan
from vllm_dflash.gpu_check.report import Report, write
from vllm_dflash.gpu_check.results import PartResult
from vllm_dflash.gpu_check.runner import Runner


def _shapes_info(plan: Plan) -> dict:
    s = plan.shapes
    return asdict(s) | {
        "feature_size": s.feature_size,
        "context_rows": s.context_rows,
        "qkv_width": s.qkv_width,
        "num_speculative_tokens": s.num_speculative_tokens,
    }


def _load_extension() -> project.Extension:
    try:
        return project.load_extension()
    except Exception as e:  # noqa: BLE001  (part (a) reports the reason)
        return project.Extension(False, f"{type(e).__name__}: {e}", None)


def _start_watchdog(limit_s: float, runner: Runner, report: Report, out: Path) -> threading.Timer:
    """A hung kernel or import cannot be interrupted from Python: after ``limit_s`` write what
    is known, name the check in progress, and end the process with exit code 1."""

    def fire() -> None:
        report.note = (
            f"stopped by the watchdog after {limit_s:.0f} s, during {runner.current or 'setup'}"
        )
        report.exit_code = 1
        report.seconds = runner.elapsed()
        if runner.current_part is not None:
            runner.current_part.status, runner.current_part.reason = "failed", report.note
        runner.say(report.note)
        report.parts.sort(key=lambda p: p.key)
        try:
            write(report, out)
        finally:
            os._exit(1)

    timer = threading.Timer(limit_s, fire)
    timer.daemon = True
    timer.start()
    return timer


def run_check(args: argparse.Namespace) -> int:
    runner = Runner(args.budget_s)
    plan = make_plan(args.dry_run, args.vllm_sources)
    out: Path = args.out
    env = environment.collect()
    ext = _load_extension()
    report = Report(
        mode=plan.mode,
        started=time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        environment=env,
        extension=asdict(ext),
        shapes=_shapes_info(plan),
        run_order="b, a, c",
    )
    runner.on_part_done = lambda: _write_progress(report, runner, out)
    runner.say(
        f"mode {plan.mode}, shapes {plan.shapes.name}, torch {env['torch']} "
        f"(CUDA {env['torch_cuda']}), GPU {env.get('gpu_name', 'none')}"
    )
    runner.say(
        f"vllm_dflash._C imported: {ext.imported}"
        + (f" ({ext.import_error})" if ext.import_error else "")
        + f"; kernels {ext.kernels}; ops.load() {ext.ops_load}"
    )
    watchdog = _start_watchdog(args.budget_s + WATCHDOG_GRACE_S, runner, report, out)
    try:
        return _run_parts(plan, ext, runner, report, out)
    finally:
        watchdog.cancel()


def _run_parts(
    plan: Plan, ext: project.Extension, runner: Runner, report: Report, out: Path
) -> int:
    def needs_device(body):
        def run_part(part: PartResult) -> None:
            if plan.device.type == "cuda" and not torch.cuda.is_available():
                part.status = "failed"
                part.reason = (
                    f"CUDA is not available: torch {torch.__version__} (built for CUDA "
                    f"{torch.version.cuda}) sees no GPU"
                )
                return
            body(part)

        return run_part

    where = "CPU kernels (dry run)" if plan.dry_run else "CUDA kernels"
    # (b) runs first: it uses no custom op, so a fault in a kernel under test in (a), which
    # poisons the CUDA context for the rest of the process, cannot take (b)'s numbers too.
    runner.part(
        "b",
        "reference drafter step timing",
        needs_device(lambda part: drafter_timing.run(part, runner, plan)),
        report.parts,
    )
    runner.part(
        "a",
        f"{where} vs the PyTorch reference",
        needs_device(lambda part: ops_check.run(part, runner, plan, ext)),
        report.parts,
    )
    runner.part(
        "c",
        "vLLM engine check",
        lambda part: engine_probe.run(part, runner, plan, out / "engine"),
        report.parts,
    )
    report.exit_code = 1 if any(p.status == "failed" for p in report.parts) else 0
    report.seconds = runner.elapsed()
    report.parts.sort(key=lambda p: p.key)
    report.vllm_in_process = any(m == "vllm" or m.startswith("vllm.") for m in sys.modules)
    js, md = write(report, out)
    for p in report.parts:
        runner.say(f"({p.key}) {p.title}: {p.status}" + (f": {p.reason}" if p.reason else ""))
    runner.say(f"wrote {js} and {md}; exit code {report.exit_code}")
    return report.exit_code


def _write_progress(report: Report, runner: Runner, out: Path) -> None:
    report.seconds = runner.elapsed()
    report.parts.sort(key=lambda p: p.key)  # run order is b, a, c; reports read a, b, c
    write(report, out)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="vllm-dflash gpu-check",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(p)
    return p


def main(argv: list[str] | None = None) -> int:
    return run_check(build_parser().parse_args(argv))
