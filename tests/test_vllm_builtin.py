"""vLLM (CPU build) serves the factory's models with its built-in dflash, and its greedy
output equals our reference engine's target-only output: the factory's checkpoints are in the
public format vLLM loads, and the reference is a faithful oracle for the serving issue."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_dflash.reference.generate import target_generate

pytestmark = pytest.mark.engine
MAX_NEW = 37


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(1234)
    return [[rng.randrange(2, 127) for _ in range(rng.randint(1, 40))] for _ in range(32)]


@pytest.fixture(scope="module")
def engine_run(target_dir, drafter_dirs, prompts, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("engine")
    request = {
        "target": str(target_dir),
        "speculative_config": {
            "method": "dflash",
            "model": str(drafter_dirs[8]),
            "num_speculative_tokens": 7,
        },
        "prompts": prompts,
        "max_tokens": MAX_NEW,
        "out": str(tmp / "out.json"),
    }
    (tmp / "req.json").write_text(json.dumps(request))
    env = os.environ | {"VLLM_CPU_KVCACHE_SPACE": "1"}
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("vllm_runner.py")), str(tmp / "req.json")],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    return json.loads((tmp / "out.json").read_text()), log


def test_builtin_dflash_matches_reference_greedy(engine_run, target, prompts):
    result, _ = engine_run
    for p, got in zip(prompts, result["outputs"], strict=True):
        assert got == target_generate(target, p, MAX_NEW).tokens


def test_plugin_line_in_engine_log(engine_run):
    _, log = engine_run
    assert "vllm-dflash: serving backend not installed yet" in log
