"""The embedded default shipped in the package: small, complete, held-out prompts really held
out, and its drafter still accepted (a regression guard on the committed weights)."""

from __future__ import annotations

import hashlib
import json
import sysconfig
from pathlib import Path

from transformers import AutoTokenizer

from vllm_dflash import assets
from vllm_dflash.bench.acceptance import measure
from vllm_dflash.checkpoint import load_drafter_checkpoint
from vllm_dflash.config import TargetConfig, check_compatible
from vllm_dflash.reference.drafter import ReferenceDrafter
from vllm_dflash.reference.target import HFTarget


def test_assets_fit_the_size_budget():
    assets.check_installed()
    size = sum(f.stat().st_size for f in assets.ROOT.rglob("*") if f.is_file())
    assert size <= 25 * 2**20, f"embedded default is {size / 2**20:.1f} MiB"


def test_target_and_drafter_belong_together():
    target = TargetConfig.from_file(assets.TARGET / "config.json")
    assert json.loads((assets.TARGET / "config.json").read_text())["architectures"] == [
        "Qwen3ForCausalLM"
    ]
    ckpt = load_drafter_checkpoint(assets.DRAFTER)
    check_compatible(ckpt.config, target)
    tok = AutoTokenizer.from_pretrained(assets.TARGET)
    assert ckpt.config.mask_token_id == tok.mask_token_id, "the tokenizer's own <|mask|>"
    assert len(tok) == target.vocab_size


def test_heldout_prompts_come_from_heldout_stdlib_files():
    """The build splits stdlib files by sha256(relative path) % 100 < 10."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    recs = [json.loads(line) for line in assets.HELDOUT_PROMPTS.read_text().splitlines()]
    assert len(recs) >= 32
    for r in recs:
        assert int(hashlib.sha256(r["file"].encode()).hexdigest(), 16) % 100 < 10, r["file"]
        assert (stdlib / r["file"]).is_file()
        assert r["prompt"].strip()


def test_bundled_drafter_is_accepted_on_heldout_prompts():
    target = HFTarget.from_pretrained(assets.TARGET)
    tok = AutoTokenizer.from_pretrained(assets.TARGET)
    lines = assets.HELDOUT_PROMPTS.read_text().splitlines()[:8]
    prompts = [tok(json.loads(line)["prompt"]).input_ids for line in lines]
    drafter = ReferenceDrafter.load(assets.DRAFTER, target)
    report = measure(target, drafter, prompts, 64, [tok.eos_token_id])
    assert report.acceptance_length > 3.5, report.table()  # 4.74 when written
