"""Start ``tests/vllm_runner.py`` in a subprocess and return its per-job results and log."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

RUNNER = Path(__file__).with_name("vllm_runner.py")


def run_engine(
    tmp: Path,
    target: str | Path,
    jobs: list[dict[str, Any]],
    speculative_config: dict[str, Any] | None = None,
    engine: dict[str, Any] | None = None,
    backend: str = "dflash",
    expect_failure: bool = False,
    env: dict[str, str] | None = None,
    plugin_stat_loggers: bool = False,
) -> tuple[dict[str, Any], str]:
    tmp.mkdir(parents=True, exist_ok=True)
    request = {
        "target": str(target),
        "speculative_config": speculative_config,
        "engine": engine or {},
        "jobs": jobs,
        "out": str(tmp / "out.json"),
        "plugin_stat_loggers": plugin_stat_loggers,
    }
    (tmp / "req.json").write_text(json.dumps(request))
    env = os.environ | {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_DFLASH_BACKEND": backend} | (env or {})
    proc = subprocess.run(
        [sys.executable, str(RUNNER), str(tmp / "req.json")],
        capture_output=True,
        text=True,
        timeout=1200,
        env=env,
    )
    log = proc.stdout + proc.stderr
    if expect_failure:
        assert proc.returncode != 0, "the engine started although its config is invalid"
        return {}, log
    assert proc.returncode == 0, log[-6000:]
    return json.loads((tmp / "out.json").read_text())["jobs"], log


def mean_acceptance_length(spec: dict[str, Any]) -> float:
    """vLLM's definition: 1 + accepted draft tokens per verify step that had drafts."""
    return 1 + spec["accepted"] / spec["drafts"]


def random_prompts(seed: int, n: int, lo: int, hi: int) -> list[list[int]]:
    """``n`` prompts of ``lo``..``hi`` token ids from the tiny target's vocabulary."""
    import random

    rng = random.Random(seed)
    return [[rng.randrange(2, 127) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def distilled_drafter(target: Any, drafter_dir: Path, out: Path, prompts: list[list[int]]):
    """``drafter_dir`` distilled on ``prompts`` (600 steps), so its drafts land there."""
    from distill import distill

    return distill(target, drafter_dir, out, prompts, steps=600)
