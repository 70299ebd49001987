"""Packaging contract: no vLLM import outside serving/plugin, entry points, version pin."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib.metadata import entry_points

from vllm_dflash import plugin

VLLM_FREE = [
    "vllm_dflash",
    "vllm_dflash.config",
    "vllm_dflash.checkpoint",
    "vllm_dflash.cli",
    "vllm_dflash.demo",
    "vllm_dflash.reference.model",
    "vllm_dflash.reference.generate",
    "vllm_dflash.reference.drafter",
    "vllm_dflash.bench.analytic",
    "vllm_dflash.bench.compare_backends",
    "vllm_dflash.bench.engine_worker",
    "vllm_dflash.bench.acceptance",
    "vllm_dflash.assets",
    "vllm_dflash.train.blocks",
    "vllm_dflash.train.loss",
    "vllm_dflash.data.records",
    "vllm_dflash.data.prompt_format",
    "vllm_dflash.train.features",
    "vllm_dflash.train.config",
    "vllm_dflash.train.trainer",
    "vllm_dflash.train.gen_data",  # imports vLLM only when it runs
    "vllm_dflash.bench.server",
    "vllm_dflash.plugin",
    "vllm_dflash.serving.seams",  # the seam table names vLLM modules; it imports none
    "vllm_dflash.serving.seams.decide",
    "vllm_dflash.serving.seams.patch",
    "vllm_dflash.serving.step_timing",
    "vllm_dflash.gpu_check.run",  # runs on GPU machines without vLLM
    "vllm_dflash.observability.names",
    "vllm_dflash.observability.baseline",
    "vllm_dflash.observability.dashboard",
    "vllm_dflash.ops",  # and the compiled extension it loads
    "vllm_dflash.ops.reference",
]


def test_core_modules_do_not_import_vllm():
    code = (
        "import importlib, sys\n"
        + "".join(f"importlib.import_module({m!r})\n" for m in VLLM_FREE)
        + "import vllm_dflash.ops; assert vllm_dflash.ops.load()\n"
        + "assert not any(m == 'vllm' or m.startswith('vllm.') for m in sys.modules), 'vllm'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


def test_entry_points_are_declared():
    plugins = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert plugins.get("dflash") == "vllm_dflash.plugin:register"
    loggers = {e.name: e.value for e in entry_points(group="vllm.stat_logger_plugins")}
    assert loggers.get("dflash") == "vllm_dflash.serving.stat_logger:DFlashStatLogger"
    scripts = {e.name: e.value for e in entry_points(group="console_scripts")}
    assert scripts["vllm-dflash"] == "vllm_dflash.cli:main"


def _load_plugins(backend: str | None, then: str = "") -> subprocess.CompletedProcess:
    code = (
        "import logging\n"
        "logging.basicConfig(level=logging.INFO)\n"
        "from vllm.plugins import load_general_plugins\n"
        "load_general_plugins()\n" + then
    )
    env = {k: v for k, v in os.environ.items() if k != plugin.BACKEND_ENV}
    if backend is not None:
        env[plugin.BACKEND_ENV] = backend
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env
    )


def test_bad_metrics_setting_stops_the_start(monkeypatch):
    monkeypatch.setenv("VLLM_DFLASH_BASELINE_EVERY", "-1")
    out = _load_plugins(None)
    assert out.returncode != 0
    assert "VLLM_DFLASH_BASELINE_EVERY='-1'" in out.stderr and "Fix:" in out.stderr


def test_bad_adaptive_setting_stops_the_start(monkeypatch):
    monkeypatch.setenv("VLLM_DFLASH_ADAPTIVE", "sometimes")
    out = _load_plugins(None)
    assert out.returncode != 0
    assert "VLLM_DFLASH_ADAPTIVE='sometimes'" in out.stderr and "Fix:" in out.stderr


def test_unknown_backend_value_stops_the_start():
    out = _load_plugins("dlfash")
    assert out.returncode != 0
    assert "VLLM_DFLASH_BACKEND='dlfash' is not a backend" in out.stderr
