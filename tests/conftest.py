"""Shared tiny models, built once per test session under pytest's temp dir."""

from __future__ import annotations

import os

import pytest
import torch
from factory import make_drafter, make_target

from vllm_dflash.reference.drafter import ReferenceDrafter
from vllm_dflash.reference.target import HFTarget

# Tiny models: one thread is as fast as two, and results (sampling tests' fixed-seed
# outcomes included) no longer depend on whether pytest-xdist runs one worker per core.
torch.set_num_threads(1)

# Engines in the tests verify a fixed number of drafts per step unless a test asks for the
# draft policy (test_draft_policy*.py): acceptance is compared with the reference engine's,
# which drafts every step. Engines inherit this from the test process's environment.
os.environ.setdefault("VLLM_DFLASH_DRAFT_POLICY", "fixed")


@pytest.fixture(scope="session")
def target_dir(tmp_path_factory):
    """Tiny Qwen3 target: vocab 128, 8 layers, hidden 64."""
    return make_target(tmp_path_factory.mktemp("models") / "target")


@pytest.fixture(scope="session")
def drafter_dirs(target_dir, tmp_path_factory):
    """z-lab-format drafters for the tiny target, one per block size."""
    root = tmp_path_factory.mktemp("drafters")
    return {b: make_drafter(root / f"b{b}", target_dir, block_size=b) for b in (4, 8, 16)}


@pytest.fixture(scope="session")
def target(target_dir):
    return HFTarget.from_pretrained(target_dir)


@pytest.fixture(scope="session")
def drafters(target, drafter_dirs):
    return {b: ReferenceDrafter.load(d, target) for b, d in drafter_dirs.items()}
