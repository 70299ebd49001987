"""Greedy DFlash == target-only greedy, token for token (docs/architecture.md §2)."""

from __future__ import annotations

import random

import pytest
import torch
from factory import make_drafter, make_target
from oracles import GreedyOracleDrafter

from vllm_dflash.reference.drafter import ReferenceDrafter
from vllm_dflash.reference.generate import spec_generate, target_generate
from vllm_dflash.reference.target import HFTarget

MAX_NEW = 37  # not a multiple of any block size: the last step is cut mid-block
BLOCK_SIZES = (4, 8, 16)


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(1234)
    return [[rng.randrange(2, 127) for _ in range(rng.randint(1, 40))] for _ in range(32)]


@pytest.fixture(scope="module")
def baselines(target, prompts):
    return [target_generate(target, p, MAX_NEW).tokens for p in prompts]


def test_target_only_loop_equals_hf_generate(target, prompts, baselines):
    """The baseline itself is checked against transformers' own greedy decoding."""
    for p, want in zip(prompts[:8], baselines[:8], strict=True):
        out = target.model.generate(
            torch.tensor([p]),
            max_new_tokens=MAX_NEW,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
        assert out[0, len(p) :].tolist() == want


def _drafter(kind, block_size, drafters, target):
    if kind == "dflash":
        return drafters[block_size]
    return GreedyOracleDrafter(target.model, block_size, accuracy=0.85, seed=block_size)


@pytest.mark.parametrize("kind", ["dflash", "oracle"])
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_greedy_matches_target_only(kind, block_size, drafters, target, prompts, baselines):
    drafter = _drafter(kind, block_size, drafters, target)
    cut_mid_block = 0
    for p, want in zip(prompts, baselines, strict=True):
        res = spec_generate(target, drafter, p, MAX_NEW)
        assert res.tokens == want
        assert res.stop_reason == "length"
        cut_mid_block += res.truncated > 0
    if kind == "oracle":
        assert cut_mid_block > 0, "no run hit max_new_tokens in the middle of a block"


@pytest.fixture(scope="module")
def stop_baselines(target, prompts, baselines):
    """Per prompt: a stop token taken from its greedy output, and target-only output with it."""
    out = []
    for i, (p, full) in enumerate(zip(prompts, baselines, strict=True)):
        stop = {full[3 + i % 25]}
        want = target_generate(target, p, MAX_NEW, stop_token_ids=stop)
        assert want.stop_reason == "stop" and want.tokens[-1] in stop
        out.append((stop, want))
    return out


@pytest.mark.parametrize("kind", ["dflash", "oracle"])
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_stop_token_mid_block(kind, block_size, drafters, target, prompts, stop_baselines):
    drafter = _drafter(kind, block_size, drafters, target)
    stopped_mid_block = 0
    for p, (stop, want) in zip(prompts, stop_baselines, strict=True):
        res = spec_generate(target, drafter, p, MAX_NEW, stop_token_ids=stop)
        assert res.tokens == want.tokens
        assert res.stop_reason == "stop"
        stopped_mid_block += res.truncated > 0
    if kind == "oracle":
        assert stopped_mid_block > 0, "no run hit its stop token in the middle of a block"


def test_oracle_exercises_full_acceptance(target, prompts):
    """The verifier's all-accepted path (bonus token) is really taken."""
    drafter = GreedyOracleDrafter(target.model, 8, accuracy=1.0)
    res = spec_generate(target, drafter, prompts[0], MAX_NEW)
    assert max(res.accepted) == 7 and res.acceptance_length > 6


def test_llama_target(tmp_path, prompts):
    """The reference engine takes any HF causal LM: a Llama target with a DFlash drafter."""
    target_dir = make_target(tmp_path / "llama", architecture="llama", num_layers=6)
    target = HFTarget.from_pretrained(target_dir)
    assert type(target.model).__name__ == "LlamaForCausalLM"
    drafter = ReferenceDrafter.load(make_drafter(tmp_path / "d", target_dir), target)
    oracle = GreedyOracleDrafter(target.model, 8, accuracy=0.85)
    for p in prompts[:8]:
        want = target_generate(target, p, MAX_NEW).tokens
        assert spec_generate(target, drafter, p, MAX_NEW).tokens == want
        assert spec_generate(target, oracle, p, MAX_NEW).tokens == want
