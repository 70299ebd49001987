"""Drafter checkpoints: loading, key/shape validation, corrupted files — one test per failure."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from vllm_dflash.checkpoint import expected_shapes, load_drafter_checkpoint
from vllm_dflash.errors import DFlashCheckpointError, DFlashConfigError
from vllm_dflash.reference.drafter import ReferenceDrafter


@pytest.fixture
def ckpt(drafter_dirs, tmp_path):
    """A private copy of the b8 drafter to break."""
    return shutil.copytree(drafter_dirs[8], tmp_path / "drafter")


def _rewrite(ckpt, edit):
    tensors = load_file(str(ckpt / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(ckpt / "model.safetensors"))


def _edit_config(ckpt, edit):
    cfg = json.loads((ckpt / "config.json").read_text())
    edit(cfg)
    (ckpt / "config.json").write_text(json.dumps(cfg))


def test_loads_the_public_key_layout(ckpt):
    loaded = load_drafter_checkpoint(ckpt)
    keys = set(loaded.state_dict)
    assert {"fc.weight", "hidden_norm.weight", "norm.weight"} <= keys
    assert "layers.1.self_attn.k_norm.weight" in keys and "layers.0.mlp.down_proj.weight" in keys
    assert not any(k.startswith("model.") for k in keys)
    assert keys == set(expected_shapes(loaded.config))


def test_embedding_and_lm_head_copies_are_ignored(ckpt):
    _rewrite(
        ckpt,
        lambda t: t.update(
            {"embed_tokens.weight": torch.zeros(128, 64), "lm_head.weight": torch.zeros(128, 64)}
        ),
    )
    assert "lm_head.weight" not in load_drafter_checkpoint(ckpt).state_dict


def test_wrong_shape(ckpt):
    want = expected_shapes(load_drafter_checkpoint(ckpt).config)["layers.0.self_attn.q_proj.weight"]
    _rewrite(ckpt, lambda t: t.update({"layers.0.self_attn.q_proj.weight": torch.zeros(32, 64)}))
    with pytest.raises(DFlashCheckpointError) as e:
        load_drafter_checkpoint(ckpt)
    assert "'layers.0.self_attn.q_proj.weight' has shape (32, 64)" in str(e.value)
    assert f"config.json implies {want}" in str(e.value) and "Fix:" in str(e.value)


def test_missing_keys(ckpt):
    _rewrite(ckpt, lambda t: t.pop("layers.1.mlp.up_proj.weight"))
    with pytest.raises(DFlashCheckpointError, match=r"missing keys \['layers.1.mlp.up_proj"):
        load_drafter_checkpoint(ckpt)


def test_prefixed_keys_are_unexpected(ckpt):
    _rewrite(ckpt, lambda t: t.update({"model." + k: t.pop(k) for k in list(t)}))
    with pytest.raises(DFlashCheckpointError, match="unexpected keys.*no 'model.' prefix"):
        load_drafter_checkpoint(ckpt)


def test_reduced_vocab_is_refused_clearly(ckpt):
    _rewrite(ckpt, lambda t: t.update({"d2t": torch.zeros(10, dtype=torch.long)}))
    with pytest.raises(DFlashCheckpointError, match="reduced draft vocabulary"):
        load_drafter_checkpoint(ckpt)


def test_out_of_range_layer_ids(ckpt, target):
    _edit_config(ckpt, lambda c: c["dflash_config"].update(target_layer_ids=[1, 12]))
    with pytest.raises(DFlashConfigError, match=r"target_layer_ids=\[1, 12\].*num_target_layers=8"):
        load_drafter_checkpoint(ckpt)


def test_layer_ids_out_of_range_for_the_target(ckpt, target):
    # Valid for the drafter's declared target, not for the one it is paired with.
    _edit_config(ckpt, lambda c: c.update(num_target_layers=16))
    with pytest.raises(DFlashConfigError, match="num_target_layers' = 16 but the target has 8"):
        ReferenceDrafter.load(ckpt, target)


def test_mask_id_outside_vocab(ckpt):
    _edit_config(ckpt, lambda c: c["dflash_config"].update(mask_token_id=500))
    with pytest.raises(DFlashConfigError, match=r"mask_token_id=500 is outside the vocabulary"):
        load_drafter_checkpoint(ckpt)


def test_truncated_safetensors(ckpt):
    data = (ckpt / "model.safetensors").read_bytes()
    (ckpt / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(DFlashCheckpointError, match="corrupted or truncated.*Fix: re-download"):
        load_drafter_checkpoint(ckpt)


def test_corrupted_safetensors_header(ckpt):
    data = bytearray((ckpt / "model.safetensors").read_bytes())
    data[8:40] = b"\xff" * 32
    (ckpt / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(DFlashCheckpointError, match="corrupted or truncated"):
        load_drafter_checkpoint(ckpt)


def test_no_weights_file(ckpt):
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(DFlashCheckpointError, match="no model.safetensors"):
        load_drafter_checkpoint(ckpt)


def test_sharded_checkpoint(ckpt):
    tensors = load_file(str(ckpt / "model.safetensors"))
    keys = sorted(tensors)
    half = len(keys) // 2
    shards = {"a.safetensors": keys[:half], "b.safetensors": keys[half:]}
    for name, ks in shards.items():
        save_file({k: tensors[k] for k in ks}, str(ckpt / name))
    (ckpt / "model.safetensors").unlink()
    index = {"weight_map": {k: n for n, ks in shards.items() for k in ks}}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    loaded = load_drafter_checkpoint(ckpt)
    assert all(torch.equal(loaded.state_dict[k], tensors[k]) for k in keys)


@pytest.mark.parametrize("bad", ["../outside.safetensors", "/etc/passwd", "sub/../../x", ""])
def test_shard_names_that_leave_the_checkpoint_are_refused(ckpt, tmp_path, bad):
    tensors = load_file(str(ckpt / "model.safetensors"))
    keys = sorted(tensors)
    save_file({k: tensors[k] for k in keys[1:]}, str(ckpt / "a.safetensors"))
    # a real file outside the checkpoint that a crafted index points at
    save_file({keys[0]: tensors[keys[0]]}, str(tmp_path / "outside.safetensors"))
    (ckpt / "model.safetensors").unlink()
    index = {"weight_map": {k: "a.safetensors" for k in keys[1:]} | {keys[0]: bad}}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(DFlashCheckpointError, match=rf"weight_map\['{keys[0]}'\].*Fix"):
        load_drafter_checkpoint(ckpt)


def test_not_a_directory(tmp_path):
    with pytest.raises(DFlashCheckpointError, match="not a directory"):
        load_drafter_checkpoint(tmp_path / "nope")
