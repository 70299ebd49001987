"""A Llama target through the real engine with our plugin: the hidden-state hook is not
Qwen3-specific. Greedy output equals the target alone, acceptance equals the reference."""

from __future__ import annotations

import random

import pytest
from distill import distill
from factory import make_drafter, make_target
from serving_harness import mean_acceptance_length, run_engine

from vllm_dflash.reference.drafter import ReferenceDrafter
from vllm_dflash.reference.generate import spec_generate, target_generate
from vllm_dflash.reference.target import HFTarget

pytestmark = pytest.mark.engine
MAX_NEW = 24
rng = random.Random(3)
PROMPTS = [[rng.randrange(2, 127) for _ in range(rng.randint(1, 40))] for _ in range(16)]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    root = tmp_path_factory.mktemp("llama")
    target_dir = make_target(root / "target", architecture="llama")
    target = HFTarget.from_pretrained(target_dir)
    random_drafter = make_drafter(root / "b4-random", target_dir, block_size=4)
    drafter_dir = distill(target, random_drafter, root / "b4", PROMPTS, steps=400)
    return target_dir, target, drafter_dir


@pytest.fixture(scope="module")
def served(llama, tmp_path_factory):
    target_dir, _, drafter_dir = llama
    spec = {"method": "dflash", "model": str(drafter_dir), "num_speculative_tokens": 3}
    jobs = [{"name": "c4", "prompts": PROMPTS, "max_tokens": MAX_NEW, "concurrency": 4}]
    return run_engine(tmp_path_factory.mktemp("engine"), target_dir, jobs, spec)


def test_llama_target_greedy_and_acceptance(llama, served):
    _, target, drafter_dir = llama
    jobs, log = served
    assert "LlamaForCausalLM" in log and "drafting from target layers" in log
    got = [r["tokens"] for r in jobs["c4"]["results"]]
    assert got == [target_generate(target, p, MAX_NEW).tokens for p in PROMPTS]
    drafter = ReferenceDrafter.load(drafter_dir, target)
    ref = [spec_generate(target, drafter, p, MAX_NEW) for p in PROMPTS]
    ref_tau = sum(sum(m + 1 for m in r.accepted) for r in ref) / sum(r.num_steps for r in ref)
    assert ref_tau > 1.5
    assert mean_acceptance_length(jobs["c4"]["spec"]) == pytest.approx(ref_tau, rel=0.02)
