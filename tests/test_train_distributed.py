"""Data-parallel training on CPU with gloo, launched by torchrun as a user would: 2 ranks
and 1 rank at the same global batch give the same loss curve, with DDP and with FSDP,
gradient accumulation included; a checkpoint written by 2 ranks resumes on 1 and
continues that curve; only rank 0 writes; a batch that does not split is refused.

Tolerance: the ranks add their gradients in another order than one process does, so float32
rounding differs and AdamW carries it on. Measured over 12 steps, the largest loss
difference was 4.8e-7 nats (DDP, FSDP, and the 2-to-1 resume alike); the bound is 1e-4.
Normalising each rank's loss by its own slice instead of the global batch (a mean of
per-rank means) gave 0.019 on the same runs, and half the global batch far more.
"""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from distill import write_samples

from vllm_dflash.train.config import TrainConfig
from vllm_dflash.train.trainer import CHECKPOINT, Trainer, load_state

TOL = 1e-4
STEPS = 12


@pytest.fixture(scope="module")
def samples(target, tmp_path_factory):
    rng = random.Random(0)
    prompts = [[rng.randrange(2, 126) for _ in range(rng.randint(6, 20))] for _ in range(64)]
    return write_samples(target, prompts, tmp_path_factory.mktemp("dp") / "samples.jsonl", 40)


def _cfg(target_dir: Path, samples: Path, out: Path, **kw) -> dict:
    return {
        "target": str(target_dir),
        "data": str(samples),
        "out": str(out),
        "eval_num_prompts": 4,
        "eval_max_tokens": 16,
        "block_size": 8,
        "num_layers": 2,
        "batch_size": 4,
        "blocks_per_seq": 4,
        "lr": 3e-3,
        "warmup_steps": 2,
        "steps": STEPS,
        "eval_every": 0,
        "save_every": 0,
    } | kw


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(cfg: dict, tmp_path: Path, ranks: int = 2) -> subprocess.CompletedProcess:
    """`torchrun --nproc-per-node N -m vllm_dflash.cli train --config cfg.json`."""
    path = tmp_path / f"cfg-{len(list(tmp_path.glob('cfg-*')))}.json"
    path.write_text(json.dumps(cfg))
    argv = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}"]
    argv += [f"--master-port={_free_port()}", "-m", "vllm_dflash.cli", "train"]
    env = os.environ | {"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run(
        [*argv, "--config", str(path)], env=env, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out


def _losses(out: Path) -> list[float]:
    return json.loads((out / "train_log.json").read_text())["log"]["loss"]


def _close(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b), (len(a), len(b))
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


@pytest.fixture(scope="module")
def one_rank(target_dir, samples, tmp_path_factory):
    """The reference: one process, the same global batch."""
    out = tmp_path_factory.mktemp("one") / "run"
    tr = Trainer(TrainConfig.from_dict(_cfg(target_dir, samples, out, grad_accum=2)))
    tr.run()
    return tr.log["loss"]


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_two_ranks_follow_the_one_rank_loss_curve(
    parallel, one_rank, target_dir, samples, tmp_path
):
    out = tmp_path / "run"
    run = _torchrun(_cfg(target_dir, samples, out, grad_accum=2, parallel=parallel), tmp_path)
    two = _losses(out)
    assert _close(two, one_rank) < TOL, (two, one_rank)
    assert one_rank[-1] < one_rank[0] - 0.3  # the curve being compared does move
    # Rank 0 alone reports and writes: one progress bar, one export.
    assert run.stderr.count("train:   0%") == 1, run.stderr[-2000:]
    assert load_state(out / CHECKPOINT)["world_size"] == 2
    assert (out / "model.safetensors").is_file() and (out / "training.png").is_file()


def test_a_two_rank_checkpoint_resumes_on_one_rank(one_rank, target_dir, samples, tmp_path):
    out = tmp_path / "run"
    _torchrun(_cfg(target_dir, samples, out, grad_accum=2, stop_after=STEPS // 2), tmp_path)
    assert load_state(out / CHECKPOINT)["step"] == STEPS // 2
    resumed = Trainer(
        TrainConfig.from_dict(_cfg(target_dir, samples, out, grad_accum=2, resume=True))
    )
    assert resumed.step == STEPS // 2
    resumed.run()
    assert _close(resumed.log["loss"], one_rank) < TOL


def test_a_wrong_reduction_is_caught(one_rank, target_dir, samples, tmp_path):
    """The check can fail: half the global batch (what one rank sees) gives another curve."""
    out = tmp_path / "half"
    tr = Trainer(TrainConfig.from_dict(_cfg(target_dir, samples, out, grad_accum=1)))
    tr.run()
    assert _close(tr.log["loss"], one_rank) > 100 * TOL


def test_a_batch_that_does_not_split_over_the_ranks_is_refused(target_dir, samples, tmp_path):
    cfg = _cfg(target_dir, samples, tmp_path / "odd", batch_size=3)
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(cfg))
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2"]
    argv += [f"--master-port={_free_port()}", "-m", "vllm_dflash.cli", "train"]
    env = os.environ | {"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run(
        [*argv, "--config", str(path)], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode != 0
    assert "field 'batch_size' = 3" in out.stdout + out.stderr
    assert "Fix: a multiple of 2" in out.stdout + out.stderr
