"""Our VLLM_DFLASH_* variables pass vLLM's own environment validation
(``--fail-on-environ-validation``), in a fresh process where vLLM loads the plugin itself,
while a variable with our prefix that we do not read is still refused."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from vllm_dflash.env_settings import ENV_PREFIX
from vllm_dflash.plugin import known_variables, settings_classes

SCRIPT = """
import sys
from vllm.engine.arg_utils import EngineArgs
args = EngineArgs(model=sys.argv[1], fail_on_environ_validation=True, max_model_len=128,
                  enforce_eager=True)
try:
    args.create_engine_config()
except ValueError as e:
    print("REFUSED", e)
    raise SystemExit(3)
print("ACCEPTED")
"""


def _validate(target_dir, extra: dict[str, str]) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_DFLASH_")}
    env |= {"VLLM_CPU_KVCACHE_SPACE": "1"} | extra
    return subprocess.run(
        [sys.executable, "-c", SCRIPT, str(target_dir)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )


@pytest.mark.parametrize("backend", ["dflash", "builtin"])
def test_every_variable_of_ours_passes_vllms_validation(target_dir, backend):
    ours = dict.fromkeys(known_variables(), "1")
    for settings in settings_classes():  # each at its default: a valid value
        for name, field in settings.model_fields.items():
            ours[ENV_PREFIX + name.upper()] = str(field.default)
    run = _validate(target_dir, ours | {"VLLM_DFLASH_BACKEND": backend})
    assert run.returncode == 0 and "ACCEPTED" in run.stdout, run.stdout + run.stderr[-3000:]


def test_a_misspelt_variable_is_still_refused(target_dir):
    run = _validate(target_dir, {"VLLM_DFLASH_DRAFT_POLCY": "fixed"})
    assert run.returncode == 3, run.stdout + run.stderr[-3000:]
    assert "Unknown vLLM environment variable detected: VLLM_DFLASH_DRAFT_POLCY" in run.stdout
