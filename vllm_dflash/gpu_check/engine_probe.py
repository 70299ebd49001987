"""Part (c): can vLLM run here, and if so, ours vs vLLM's built-in DFlash vs no speculation.

Every vLLM import runs in its own subprocess with a timeout, so this process stays vLLM-free
and a hanging or crashing import costs one step, not the run. Without --vllm-sources the
probe is ``import vllm``; with it (a vLLM checkout, put first on PYTHONPATH) four steps, each
recorded on its own: the package, the GPU model runner, the compiled ops, the LLM class.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from vllm_dflash import assets
from vllm_dflash.gpu_check.plan import Plan
from vllm_dflash.gpu_check.results import CheckFailed, Outcome, PartResult, Table
from vllm_dflash.gpu_check.runner import Runner

_VERSION = (
    "import json, vllm; print(json.dumps({'version': vllm.__version__, 'file': vllm.__file__}))"
)
PROBE_STEPS: tuple[tuple[str, str], ...] = (
    ("import vllm", _VERSION),
    ("import vllm.v1.worker.gpu.model_runner", "import vllm.v1.worker.gpu.model_runner"),
    ("import vllm._C", "import vllm._C"),
    ("from vllm import LLM", "from vllm import LLM"),
)
TAIL_LINES = 15
BENCH_BACKENDS = "dflash,builtin,none"


@dataclass
class ProbeResult:
    step: str
    ok: bool
    seconds: float
    returncode: int | None
    error: str | None  # the last line of stderr (the exception), or the timeout
    stdout: str
    stderr_tail: str


def _env(sources: Path | None) -> dict[str, str]:
    env = os.environ.copy()
    if sources is not None:
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(sources.resolve()), env.get("PYTHONPATH", "")) if p
        )
    return env


def _tail(text: str | bytes | None, lines: int = TAIL_LINES) -> str:
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return "\n".join((text or "").rstrip().splitlines()[-lines:])


def run_python(
    step: str, args: list[str], sources: Path | None, timeout: float, cwd: Path | None = None
) -> ProbeResult:
    """``python ARGS`` in a subprocess: ok when it exits 0 within ``timeout`` seconds."""
    t0 = time.monotonic()
    try:
        proc = subprocess.run(
            [sys.executable, *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=_env(sources),
            cwd=cwd,
        )
    except subprocess.TimeoutExpired as e:
        return ProbeResult(
            step,
            False,
            time.monotonic() - t0,
            None,
            f"timed out after {timeout:.0f} s",
            _tail(e.stdout),
            _tail(e.stderr),
        )
    tail = _tail(proc.stderr)
    error = None
    if proc.returncode != 0:
        error = tail.splitlines()[-1] if tail else f"exit code {proc.returncode}, no stderr"
    return ProbeResult(
        step,
        proc.returncode == 0,
        time.monotonic() - t0,
        proc.returncode,
        error,
        _tail(proc.stdout),
        tail,
    )


def probe(step: str, code: str, sources: Path | None, timeout: float) -> ProbeResult:
    return run_python(step, ["-c", code], sources, timeout)


def plugin_installed() -> bool:
    """vLLM loads our plugin through this entry point; a source checkout alone has none."""
    eps = importlib.metadata.entry_points(group="vllm.general_plugins")
    return any(ep.value.startswith("vllm_dflash") for ep in eps)


def engine_comparison(plan: Plan, part: PartResult, workdir: Path, timeout: float) -> Outcome:
    """``vllm-dflash bench`` (ours, built-in DFlash with VLLM_DFLASH_BACKEND=builtin, none) on the
    embedded default's target and drafter (shipped in the package), each engine in a subprocess."""
    if not plugin_installed():
        raise CheckFailed(
            "vllm_dflash is not installed here (no 'vllm.general_plugins' entry point), so "
            "vLLM cannot load the DFlash plugin. Fix: pip install --no-build-isolation "
            "--no-deps -e ."
        )
    workdir.mkdir(parents=True, exist_ok=True)
    assets.check_installed()
    target, drafter = str(assets.TARGET), str(assets.DRAFTER)
    t0 = time.monotonic()
    rows_json = workdir / "bench.json"
    rows_json.unlink(missing_ok=True)  # never read an earlier run's rows
    bench = run_python(
        "vllm-dflash bench",
        [
            "-m",
            "vllm_dflash",
            "bench",
            "--target",
            target,
            "--draft",
            drafter,
            "--backends",
            BENCH_BACKENDS,
            "--concurrency",
            "1,4",
            "--num-prompts",
            "8",
            "--max-tokens",
            "32",
            "--repeats",
            "1",
            "--json",
            str(rows_json),
            "--workdir",
            str(workdir / "bench"),
        ],
        plan.vllm_sources,
        max(1.0, timeout - (time.monotonic() - t0)),
    )
    rows = json.loads(rows_json.read_text()) if rows_json.is_file() else []
    if rows:
        part.tables.append(
            Table(
                "Engine comparison (the embedded default, greedy)",
                ["backend", "concurrency", "tok/s", "acceptance length", "vs none", "= none"],
                [
                    [
                        r["backend"],
                        r["concurrency"],
                        f"{r['tokens_per_s']:.1f}",
                        "-" if r["acceptance_length"] is None else f"{r['acceptance_length']:.2f}",
                        f"{r['speedup_vs_none']:.2f}x",
                        "yes" if r["matches_none"] else "NO",
                    ]
                    for r in rows
                ],
                note="The embedded default is a few-MB model: the GPU is idle most of a step, so "
                "the point is that every backend runs and greedy output equals no speculation's.",
            )
        )
    metrics = {
        "rows": rows,
        "bench": asdict(bench),
        "stderr_tail": bench.stderr_tail,
    }
    if bench.returncode == 1 and rows:
        differ = sorted({r["backend"] for r in rows if not r["matches_none"]})
        raise CheckFailed(f"greedy output differs from no speculation: {differ}", metrics)
    if not bench.ok:
        raise CheckFailed(f"vllm-dflash bench failed: {bench.error}", metrics)
    return Outcome(f"{len(rows)} rows, greedy equal to no speculation", metrics)


def run(part: PartResult, runner: Runner, plan: Plan, workdir: Path) -> None:
    sources = plan.vllm_sources
    part.info["vllm_sources"] = str(sources) if sources else None
    steps = PROBE_STEPS if sources is not None else PROBE_STEPS[:1]
    results: list[ProbeResult] = []

    for name, code in steps:

        def body(name=name, code=code) -> Outcome:
            timeout = max(1.0, min(plan.probe_timeout_s, runner.budget_s - runner.elapsed()))
            r = probe(name, code, sources, timeout)
            results.append(r)
            if not r.ok:
                raise CheckFailed(f"not importable: {r.error}", asdict(r))
            if name == "import vllm" and r.stdout:
                found = json.loads(r.stdout.splitlines()[-1])
                part.info["vllm_version"], part.info["vllm_file"] = found["version"], found["file"]
                return Outcome(f"vLLM {found['version']} from {found['file']}", asdict(r))
            return Outcome("importable", asdict(r))

        runner.check(part, f"probe: {name}", body)

    part.tables.append(
        Table(
            "vLLM import probe (each step in its own subprocess"
            + (f", PYTHONPATH={sources}" if sources else "")
            + ")",
            ["step", "result", "seconds", "error (last stderr line)"],
            [
                [r.step, "ok" if r.ok else "fails", f"{r.seconds:.1f}", r.error or ""]
                for r in results
            ],
        )
    )
    importable = len(results) == len(steps) and all(r.ok for r in results)
    kit_error = any(c.traceback for c in part.checks)
    first = next((r for r in results if not r.ok), None)
    blocked = f"{first.step}: {first.error}" if first else "the probe did not run"
    if plan.dry_run:
        skip = "dry run: no engine started"
    elif not importable:
        skip = f"not run on this machine: vLLM is not usable here ({blocked})"
    else:
        skip = None
    timeout = max(1.0, min(plan.engine_timeout_s, runner.budget_s - runner.elapsed()))
    runner.check(
        part,
        "engine comparison (ours vs builtin vs none)",
        lambda: engine_comparison(plan, part, workdir, timeout),
        skip=skip,
    )
    if not importable and not kit_error:
        # vLLM missing is a fact about this machine, recorded above; not a failed check.
        part.status = "skipped"
        part.reason = f"vLLM not usable here ({blocked}); engine comparison not run"
