"""The `vllm-dflash` command as a user runs it (a real subprocess of the installed script)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

CLI = Path(sys.executable).with_name("vllm-dflash")


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(CLI), *args], capture_output=True, text=True, timeout=600)


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


def test_train_and_eval_commands(target_dir, tmp_path):
    """`train` from a TOML config with a flag on top, then `eval` of its export."""
    import random

    from distill import write_samples

    from vllm_dflash.reference.target import HFTarget

    rng = random.Random(3)
    prompts = [[rng.randrange(2, 126) for _ in range(8)] for _ in range(12)]
    samples = write_samples(HFTarget.from_pretrained(target_dir), prompts, tmp_path / "s.jsonl", 24)
    held = tmp_path / "held.jsonl"
    held.write_text("".join(json.dumps({"prompt_token_ids": p}) + "\n" for p in prompts[:3]))
    cfg = tmp_path / "train.toml"
    cfg.write_text(
        f'target = "{target_dir}"\ndata = "{samples}"\nout = "{tmp_path / "d"}"\n'
        f'eval_prompts = "{held}"\nblock_size = 4\nnum_layers = 1\nsteps = 50\n'
    )
    flags = ["--steps", "6", "--eval-num-prompts", "3", "--train-block-sizes", "2,4"]
    out = _run("train", "--config", str(cfg), *flags)
    assert out.returncode == 0, out.stderr[-3000:]
    log = json.loads((tmp_path / "d" / "train_log.json").read_text())
    assert len(log["log"]["loss"]) == 6, "the flag overrides the file"
    assert log["config"]["train_block_sizes"] == [2, 4]
    bad = _run("train", "--config", str(cfg), "--train-block-sizes", "2,x")
    assert bad.returncode == 2 and "field 'train_block_sizes'" in bad.stderr
    assert "Traceback" not in bad.stderr
    ev = _run(
        "eval",
        "--target",
        str(target_dir),
        "--draft",
        str(tmp_path / "d"),
        "--prompts",
        str(held),
        "--max-tokens",
        "16",
        "--json",
        str(tmp_path / "ev.json"),
    )
    assert ev.returncode == 0, ev.stderr[-3000:]
    report = json.loads((tmp_path / "ev.json").read_text())
    assert report["num_prompts"] == 3 and 1.0 <= report["acceptance_length"] <= 4.0
    assert len(report["per_position"]) == 3 and "tau =" in ev.stdout


def test_train_rejects_bad_config_before_training(target_dir, tmp_path):
    cfg = tmp_path / "train.json"
    cfg.write_text(json.dumps({"target": str(target_dir), "data": "x", "out": "y", "lr": "fast"}))
    out = _run("train", "--config", str(cfg), "--block-size", "1")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "field 'lr'" in out.stderr and "field 'block_size'" in out.stderr


def test_serve_default_hands_every_argument_to_vllm():
    """Options may come first (`serve-default --port 8000`, as the CPU image runs it; `serve`
    takes the same path); vLLM's parser, not ours, answers them."""
    out = _run("serve-default", "--help")
    assert out.returncode == 0, out.stderr
    assert "usage: vllm serve" in out.stdout
    bad = _run("serve-default", "--no-such-flag")
    assert bad.returncode != 0 and "--no-such-flag" in bad.stderr
