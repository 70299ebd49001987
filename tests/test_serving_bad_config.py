"""A bad drafter or speculative config stops the engine at start with a message that names
the field and the fix. Each case starts a real engine (CPU build) and expects it to fail."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from factory import build_tokenizer, make_drafter, make_target
from serving_harness import run_engine

from vllm_dflash.bench.compare_backends import cpu_binding

pytestmark = pytest.mark.engine
JOBS = [{"name": "one", "prompts": [[5, 6, 7]], "max_tokens": 4}]


def _edited(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    edit(cfg)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _gpt2_target(out: Path) -> Path:
    """A target vLLM serves but whose model cannot return intermediate hidden states."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=128, n_embd=64, n_layer=8, n_head=2, n_positions=512)
    GPT2LMHeadModel(cfg).save_pretrained(out)
    build_tokenizer(128).save_pretrained(out)
    return out


def _drafters(root: Path, target_dir: Path, good: Path) -> dict[str, tuple[Path, int, Path]]:
    """case -> (target, num_speculative_tokens, drafter)."""
    wide = make_target(root / "wide-target", hidden_size=128)
    big_vocab = make_target(root / "big-vocab-target", vocab_size=256)
    return {
        "hidden_size": (target_dir, 7, make_drafter(root / "wide", wide, block_size=8)),
        "vocab_size": (target_dir, 7, make_drafter(root / "vocab", big_vocab, block_size=8)),
        "dflash_config.target_layer_ids": (
            target_dir,
            7,
            _edited(good, root / "ids", lambda c: c["dflash_config"].update(target_layer_ids=[7])),
        ),
        "dflash_config.mask_token_id": (
            target_dir,
            7,
            _edited(good, root / "mask", lambda c: c["dflash_config"].pop("mask_token_id")),
        ),
        "num_speculative_tokens": (target_dir, 8, good),
        "architectures": (
            target_dir,
            7,
            _edited(good, root / "arch", lambda c: c.update(architectures=["Qwen3ForCausalLM"])),
        ),
        "target architecture GPT2LMHeadModel": (_gpt2_target(root / "gpt2"), 7, good),
    }


@pytest.fixture(scope="module")
def cases(target_dir, drafter_dirs, tmp_path_factory):
    return _drafters(tmp_path_factory.mktemp("bad"), target_dir, drafter_dirs[8])


FIXES = {
    "hidden_size": "Fix: use a drafter trained for this target",
    "vocab_size": "Fix: use a drafter trained for this target",
    "dflash_config.target_layer_ids": "Fix: use ids in [0, 6]",
    "dflash_config.mask_token_id": "Field required",
    "num_speculative_tokens": "Fix: set num_speculative_tokens between 1 and 7",
    "architectures": "Fix: point --speculative-config 'model' at a DFlash drafter",
    "target architecture GPT2LMHeadModel": "Fix: serve a target whose vLLM model implements",
}


@pytest.mark.parametrize("field", list(FIXES))
def test_engine_refuses_to_start(cases, field, tmp_path):
    target, k, drafter = cases[field]
    spec = {"method": "dflash", "model": str(drafter), "num_speculative_tokens": k}
    _, log = run_engine(tmp_path, target, JOBS, spec, expect_failure=True)
    assert field in log, log[-3000:]
    assert FIXES[field] in log, log[-3000:]


# Parallel layouts our proposer does not serve: (engine args, speculative-config extras,
# drafter config edit or None, the field and the fix the message must name).
PARALLEL = {
    "draft_tensor_parallel_size": (
        {"tensor_parallel_size": 2},
        {"draft_tensor_parallel_size": 3},
        None,
        "Fix: leave draft_tensor_parallel_size out or set it to 2",
    ),
    "pipeline_parallel_size": (
        {"pipeline_parallel_size": 2},
        {},
        None,
        "Fix: use tensor parallelism only",
    ),
    "num_attention_heads": (
        {"tensor_parallel_size": 2},
        {},
        lambda c: c.update(num_attention_heads=3, num_key_value_heads=1),
        "does not split into 2 equal parts. Fix: serve with a tensor_parallel_size that",
    ),
}


@pytest.mark.parametrize("field", list(PARALLEL))
def test_engine_refuses_parallel_layout(drafter_dirs, target_dir, field, tmp_path):
    engine, extra, edit, fix = PARALLEL[field]
    drafter = drafter_dirs[8] if edit is None else _edited(drafter_dirs[8], tmp_path / "d", edit)
    spec = {"method": "dflash", "model": str(drafter), "num_speculative_tokens": 7} | extra
    env = {"VLLM_CPU_OMP_THREADS_BIND": cpu_binding(2)}
    _, log = run_engine(tmp_path, target_dir, JOBS, spec, engine, expect_failure=True, env=env)
    assert f"field '{field}'" in log, log[-3000:]
    assert fix in log, log[-3000:]
