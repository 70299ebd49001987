"""Packaging contract: no vLLM import outside serving/plugin, entry points, version pin."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import entry_points

from vllm_dflash import plugin
from vllm_dflash.versions import SUPPORTED_VLLM_VERSIONS

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
    "vllm_dflash.testing.factory",
    "vllm_dflash.testing.oracles",
    "vllm_dflash.plugin",
]


def test_core_modules_do_not_import_vllm():
    code = (
        "import importlib, sys\n"
        + "".join(f"importlib.import_module({m!r})\n" for m in VLLM_FREE)
        + "assert not any(m == 'vllm' or m.startswith('vllm.') for m in sys.modules), 'vllm'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


def test_entry_points_are_declared():
    plugins = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert plugins.get("dflash") == "vllm_dflash.plugin:register"
    scripts = {e.name: e.value for e in entry_points(group="console_scripts")}
    assert scripts["vllm-dflash"] == "vllm_dflash.cli:main"


def test_version_check_messages():
    assert plugin.version_problem(SUPPORTED_VLLM_VERSIONS[0]) is None
    assert plugin.version_problem(SUPPORTED_VLLM_VERSIONS[0] + "+cpu") is None
    msg = plugin.version_problem("0.10.1")
    assert "0.10.1 is not a supported version" in msg and "Fix:" in msg
    assert "not installed" in plugin.version_problem(None)


def test_installed_vllm_is_supported():
    assert plugin.version_problem(plugin.installed_vllm_version()) is None


def test_vllm_loader_runs_register():
    """vLLM's own loader finds and runs our entry point (engine logs: test_vllm_builtin)."""
    code = (
        "import logging\n"
        "logging.basicConfig(level=logging.INFO)\n"
        "from vllm.plugins import load_general_plugins\n"
        "load_general_plugins()\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True
    )
    assert "vllm-dflash: serving backend not installed yet" in out.stdout + out.stderr
