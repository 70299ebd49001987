"""The `vllm-dflash` command as a user runs it (a real subprocess of the installed script)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

CLI = Path(sys.executable).with_name("vllm-dflash")


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(CLI), *args], capture_output=True, text=True, timeout=600)


def test_demo_prints_measured_numbers(tmp_path):
    out = _run("demo", "--workdir", str(tmp_path), "--num-prompts", "2", "--max-tokens", "16")
    assert out.returncode == 0, out.stderr
    rows = dict(
        re.split(r"\s{2,}", line.strip(), maxsplit=1)
        for line in out.stdout.splitlines()
        if re.search(r"\S\s{2,}\S", line)
    )
    assert rows["lossless (greedy, token for token)"] == "yes"
    assert 1.0 <= float(rows["acceptance length tau"]) <= 8.0
    for rate in ("target-only decode tok/s", "DFlash decode tok/s"):
        assert float(rows[rate]) > 0
    assert rows["speedup (measured)"].endswith("x")
    assert (tmp_path / "target" / "tokenizer.json").is_file()  # built, not downloaded


def test_check_draft_ok(drafter_dirs, target_dir):
    out = _run("check-draft", str(drafter_dirs[16]), "--target", str(target_dir))
    assert out.returncode == 0, out.stderr
    assert "block_size=16 (15 draft tokens)" in out.stdout and "compatible" in out.stdout


def test_check_draft_reports_bad_field(drafter_dirs, tmp_path):
    bad = shutil.copytree(drafter_dirs[8], tmp_path / "bad")
    cfg = json.loads((bad / "config.json").read_text())
    cfg["dflash_config"]["mask_token_id"] = 9999
    (bad / "config.json").write_text(json.dumps(cfg))
    out = _run("check-draft", str(bad))
    assert out.returncode == 2
    assert "mask_token_id=9999" in out.stderr and "Fix:" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize("args", [["--version"], ["demo", "--help"]])
def test_help_and_version(args):
    out = _run(*args)
    assert out.returncode == 0 and out.stdout
