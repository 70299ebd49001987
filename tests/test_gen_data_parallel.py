"""`gen-data --data-parallel-size N`: which devices each engine gets, and the settings it
refuses (the engines themselves run in test_gen_data.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_dflash.errors import DFlashConfigError
from vllm_dflash.train.gen_data_parallel import engine_envs

CLI = Path(sys.executable).with_name("vllm-dflash")


def test_each_engine_gets_its_own_group_of_visible_gpus():
    env = {"CUDA_VISIBLE_DEVICES": "4,5,6,7"}
    assert engine_envs(2, 2, env) == [
        {"CUDA_VISIBLE_DEVICES": "4,5"},
        {"CUDA_VISIBLE_DEVICES": "6,7"},
    ]
    assert [e["CUDA_VISIBLE_DEVICES"] for e in engine_envs(4, 1, env)] == ["4", "5", "6", "7"]
    with pytest.raises(DFlashConfigError, match="needs 6 GPUs, 4 are visible"):
        engine_envs(3, 2, env)


def test_without_gpus_each_engine_gets_its_own_cores():
    cores = sorted(os.sched_getaffinity(0))
    envs = engine_envs(len(cores), 1, {"CUDA_VISIBLE_DEVICES": ""})
    assert [e["VLLM_CPU_OMP_THREADS_BIND"] for e in envs] == [str(c) for c in cores]
    with pytest.raises(DFlashConfigError, match=f"needs {len(cores) + 1} CPU cores"):
        engine_envs(len(cores) + 1, 1, {"CUDA_VISIBLE_DEVICES": ""})


def test_data_parallel_does_not_combine_with_a_hand_picked_shard(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "prompt": "x"}\n')
    args = [str(CLI), "gen-data", "--target", str(tmp_path), "--prompts", str(prompts)]
    args += ["--out", str(tmp_path / "out"), "--data-parallel-size", "2", "--num-shards", "4"]
    run = subprocess.run(args, capture_output=True, text=True)
    assert run.returncode == 2
    assert "does not combine with --num-shards/--shard-index" in run.stderr
    assert not (tmp_path / "out").exists(), "refused before any engine started"


def test_the_generation_window_leaves_the_engines_start_out(tmp_path, capsys):
    from vllm_dflash.train.gen_data_parallel import _read_stats, generation_window

    # Engine 0 generated from t=100 to 130, engine 1 (slower to start) from 110 to 140;
    # a shard that had nothing left to do, or died before writing, adds no time.
    stats = [
        {"prompts": 5, "tokens": 50, "start": 100.0, "end": 130.0},
        {"prompts": 5, "tokens": 60, "start": 110.0, "end": 140.0},
        {"prompts": 0, "tokens": 0, "start": None, "end": None},
        {},
    ]
    assert generation_window(stats) == (100.0, 140.0)
    assert generation_window(stats[2:]) is None
    # A stats file that cannot be read drops its shard from the rate, and says so.
    bad = tmp_path / "shard-1.stats.json"
    bad.write_text('{"prompts": 5, "tok')
    assert _read_stats(bad) == {} and _read_stats(tmp_path / "missing.json") == {}
    assert f"{bad} is not valid JSON" in capsys.readouterr().err
