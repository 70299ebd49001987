"""Drafter config validation: each malformed field fails with its name, value and a fix."""

from __future__ import annotations

import json

import pytest

from vllm_dflash.config import (
    DrafterConfig,
    TargetConfig,
    check_compatible,
    default_target_layer_ids,
)
from vllm_dflash.errors import DFlashConfigError


@pytest.fixture
def good(drafter_dirs):
    return json.loads((drafter_dirs[8] / "config.json").read_text())


def _error(data) -> str:
    with pytest.raises(DFlashConfigError) as e:
        DrafterConfig.from_dict(data)
    msg = str(e.value)
    # One short line per problem, never a dump of the whole config.
    assert all(len(line) < 300 for line in msg.splitlines()), msg
    return msg


def test_valid_config_round_trips(good):
    cfg = DrafterConfig.from_dict(good)
    assert cfg.block_size == 8 and cfg.num_speculative_tokens == 7
    assert DrafterConfig.from_dict(cfg.to_dict()) == cfg


def test_default_layer_rule_matches_public_checkpoints():
    # z-lab/Qwen3-8B-DFlash-b16: 36 target layers, 5 drafter layers.
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    # Qwen3-4B: 36 layers too; a 28-layer target gives the paper's spacing.
    assert default_target_layer_ids(28, 5) == [1, 7, 13, 19, 25]
    assert default_target_layer_ids(8, 1) == [4]


def test_absent_layer_ids_use_the_rule(good):
    del good["dflash_config"]["target_layer_ids"]
    cfg = DrafterConfig.from_dict(good)
    assert cfg.target_layer_ids == default_target_layer_ids(8, cfg.num_hidden_layers)


@pytest.mark.parametrize(
    ("mutate", "needles"),
    [
        (
            lambda d: d.update(architectures=["Qwen3ForCausalLM"]),
            ["architectures", "Qwen3ForCausalLM", "DFlashDraftModel"],
        ),
        (
            lambda d: d["dflash_config"].pop("mask_token_id"),
            ["dflash_config.mask_token_id", "<missing>", "Fix:"],
        ),
        (
            lambda d: d["dflash_config"].update(mask_token_id=128),
            ["mask_token_id=128", "vocab_size=128", "Fix:"],
        ),
        (
            lambda d: d["dflash_config"].update(target_layer_ids=[1, 9]),
            ["target_layer_ids=[1, 9]", "num_target_layers=8", "Fix:"],
        ),
        (
            lambda d: d["dflash_config"].update(target_layer_ids=[3, 3]),
            ["target_layer_ids", "no duplicates", "Fix:"],
        ),
        (lambda d: d.update(block_size=1), ["block_size", "1", "Fix:"]),
        (lambda d: d.update(block_size="sixteen"), ["block_size", "'sixteen'"]),
        (lambda d: d.pop("num_target_layers"), ["num_target_layers", "<missing>", "Fix:"]),
        (lambda d: d.update(num_key_value_heads=3), ["num_key_value_heads=3", "Fix:"]),
        (lambda d: d.update(rope_scaling={"rope_type": "yarn", "factor": 4.0}), ["yarn", "Fix:"]),
        (lambda d: d.update(rope_scaling={"type": "linear", "factor": 2.0}), ["'linear'", "Fix:"]),
        (lambda d: d.update(model_type="gpt2"), ["model_type", "'gpt2'", "qwen3"]),
        (lambda d: d["dflash_config"].update(target_layer_ids=[5, 1]), ["strictly increasing"]),
        (lambda d: d.update(is_causal=True), ["is_causal=True", "Fix:"]),
        (lambda d: d["dflash_config"].update(causal=True), ["dflash_config.causal", "Fix:"]),
        (lambda d: d["dflash_config"].update(use_swa=True), ["dflash_config.use_swa", "Fix:"]),
        (lambda d: d.update(use_sliding_window=True), ["use_sliding_window", "Fix:"]),
        (
            lambda d: d.update(layer_types=["full_attention", "sliding_attention"]),
            ["layer_types", "sliding_attention", "Fix:"],
        ),
        (
            lambda d: d.update(
                rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                rope_scaling={"rope_type": "yarn", "factor": 4.0},
            ),
            ["yarn"],
        ),
    ],
)
def test_bad_field_is_named_with_value_and_fix(good, mutate, needles):
    mutate(good)
    msg = _error(good)
    for needle in needles:
        assert needle in msg, f"{needle!r} not in: {msg}"


def test_bad_json_file(tmp_path):
    (tmp_path / "config.json").write_text('{"block_size": 8,')
    with pytest.raises(DFlashConfigError, match=r"not valid JSON \(line 1"):
        DrafterConfig.from_file(tmp_path / "config.json")


def test_missing_file(tmp_path):
    with pytest.raises(DFlashConfigError, match="file not found"):
        DrafterConfig.from_file(tmp_path / "config.json")


def _target(**kw) -> TargetConfig:
    base = dict(model_type="qwen3", hidden_size=64, vocab_size=128, num_hidden_layers=8)
    return TargetConfig.from_dict(base | kw)


def test_compatible_with_its_target(good):
    check_compatible(DrafterConfig.from_dict(good), _target())


@pytest.mark.parametrize(
    ("target_kw", "needles"),
    [
        ({"hidden_size": 128}, ["'hidden_size' = 64", "hidden_size is 128"]),
        ({"vocab_size": 256}, ["'vocab_size' = 128", "vocab_size is 256"]),
        ({"vocab_size": 100}, ["mask_token_id' = 127", "vocab_size=100"]),
        ({"num_hidden_layers": 4}, ["num_target_layers' = 8", "out of range", "[0, 2]"]),
    ],
)
def test_incompatible_target_is_explained(good, target_kw, needles):
    with pytest.raises(DFlashConfigError) as e:
        check_compatible(DrafterConfig.from_dict(good), _target(**target_kw))
    for needle in needles:
        assert needle in str(e.value), f"{needle!r} not in: {e.value}"


def test_last_target_layer_is_rejected(good):
    # The last layer's pre-norm output is not exposed by HF (hidden_states[-1] is normed).
    good["dflash_config"]["target_layer_ids"] = [1, 7]
    assert "Fix: use ids in [0, 6]" in _error(good)


def test_layer_range_advice_is_accepted(good):
    """The range an error suggests is one the checks then accept."""
    good["dflash_config"]["target_layer_ids"] = [1, 6]
    check_compatible(DrafterConfig.from_dict(good), _target())


def test_default_rule_refuses_a_too_shallow_target():
    with pytest.raises(DFlashConfigError, match="too shallow.*Fix: set dflash_config"):
        default_target_layer_ids(4, 2)  # the formula would give [1, 1]


def test_mismatch_report_does_not_invent_fields(good):
    with pytest.raises(DFlashConfigError) as e:
        check_compatible(DrafterConfig.from_dict(good), _target(hidden_size=128))
    assert "target_hidden_size" not in str(e.value)  # absent from config.json


def test_error_without_source_has_one_prefix(good):
    good["block_size"] = 0
    assert _error(good).startswith("invalid DFlash drafter config:\n")


def test_multimodal_target_config_uses_text_config():
    cfg = TargetConfig.from_dict(
        {
            "model_type": "qwen3_5",
            "text_config": {"hidden_size": 64, "vocab_size": 128, "num_hidden_layers": 8},
        }
    )
    assert cfg.hidden_size == 64 and cfg.num_hidden_layers == 8
