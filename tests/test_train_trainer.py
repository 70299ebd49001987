"""The trainer on the tiny factory target: it learns, freezes what it must, resumes exactly,
reads offline features like online ones, and refuses bad configs before any step."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from distill import write_samples
from factory import make_drafter, make_target

from vllm_dflash.bench.acceptance import measure
from vllm_dflash.checkpoint import load_drafter_checkpoint
from vllm_dflash.errors import DFlashConfigError, DFlashDataError
from vllm_dflash.reference.drafter import ReferenceDrafter
from vllm_dflash.train.config import TrainConfig
from vllm_dflash.train.features import OfflineFeatures, capture, target_features
from vllm_dflash.train.trainer import CHECKPOINT, Trainer, load_state


def _prompts(seed: int, n: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, 126) for _ in range(rng.randint(6, 20))] for _ in range(n)]


@pytest.fixture(scope="module")
def data(target, tmp_path_factory):
    """Self-distilled samples for 200 training prompts, and 8 held-out prompts."""
    root = tmp_path_factory.mktemp("train-data")
    samples = write_samples(target, _prompts(0, 200), root / "samples.jsonl", 48)
    held = root / "held_out.jsonl"
    held.write_text("".join(json.dumps({"prompt_token_ids": p}) + "\n" for p in _prompts(1, 8)))
    return samples, held


def _cfg(target_dir, data, out, **kw) -> TrainConfig:
    samples, held = data
    base = {
        "target": target_dir,
        "data": samples,
        "out": out,
        "eval_prompts": held,
        "eval_num_prompts": 8,
        "eval_max_tokens": 32,
        "block_size": 8,
        "num_layers": 2,
        "num_feature_layers": 5,
        "batch_size": 4,
        "blocks_per_seq": 8,
        "lr": 3e-3,
        "warmup_steps": 5,
        "eval_every": 0,
        "save_every": 0,
    }
    return TrainConfig.load(None, base | kw)


def test_short_run_lowers_loss_and_beats_random_init(target, target_dir, data, tmp_path):
    tr = Trainer(_cfg(target_dir, data, tmp_path / "run", steps=400, eval_every=200, batch_size=8))
    before = tr.evaluate().acceptance_length  # the random-init drafter, same prompts
    out = tr.run()
    loss = tr.log["loss"]
    assert sum(loss[-20:]) / 20 < 0.6 * sum(loss[:20]) / 20
    after = tr.log["eval"][-1]["tau"]
    assert after > before + 0.3, (before, after)
    assert [e["step"] for e in tr.log["eval"]] == [0, 200, 400]
    # The export is a z-lab checkpoint the reference engine loads and reproduces.
    drafter = ReferenceDrafter.load(out, target)
    prompts = [json.loads(line)["prompt_token_ids"] for line in data[1].read_text().splitlines()]
    assert measure(target, drafter, prompts, 32).acceptance_length == pytest.approx(after)
    assert (out / "training.png").stat().st_size > 0
    log = json.loads((out / "train_log.json").read_text())
    assert log["decay_gamma"] == 4.0 and len(log["log"]["loss"]) == 400


def test_step_updates_drafter_only(target_dir, data, tmp_path):
    tr = Trainer(_cfg(target_dir, data, tmp_path / "run", steps=3))
    frozen = {k: v.clone() for k, v in tr.target.model.state_dict().items()}
    trained = {k: v.clone() for k, v in tr.model.state_dict().items()}
    tr.train_step()
    for k, v in tr.target.model.state_dict().items():
        assert torch.equal(v, frozen[k]), f"target parameter {k} changed"
    assert all(p.grad is None for p in tr.target.model.parameters())
    changed = [k for k, v in tr.model.state_dict().items() if not torch.equal(v, trained[k])]
    assert "fc.weight" in changed and "layers.0.self_attn.k_proj.weight" in changed
    # Embedding and LM head are the target's: the checkpoint does not store them.
    keys = load_drafter_checkpoint(tr.export()).state_dict
    assert not any("embed" in k or "lm_head" in k for k in keys)


def test_resume_continues_the_same_loss_curve(target_dir, data, tmp_path):
    straight = Trainer(_cfg(target_dir, data, tmp_path / "a", steps=8, save_every=4))
    straight.run()
    first = Trainer(_cfg(target_dir, data, tmp_path / "b", steps=8, save_every=4))
    first.run(until=4)
    resumed = Trainer(_cfg(target_dir, data, tmp_path / "b", steps=8, save_every=4, resume=True))
    assert resumed.step == 4
    resumed.run()
    assert resumed.log["loss"] == straight.log["loss"]
    a = load_drafter_checkpoint(tmp_path / "a").state_dict
    b = load_drafter_checkpoint(tmp_path / "b").state_dict
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_resume_refuses_changed_settings(target_dir, data, tmp_path):
    Trainer(_cfg(target_dir, data, tmp_path / "r", steps=2)).run()
    with pytest.raises(DFlashConfigError, match=r"\['lr'\]"):
        Trainer(_cfg(target_dir, data, tmp_path / "r", steps=2, lr=1e-3, resume=True))
    with pytest.raises(DFlashConfigError, match="does not exist"):
        Trainer(_cfg(target_dir, data, tmp_path / "none", resume=True))


class _RunsCode:
    """Unpickling this calls a function: what a crafted checkpoint would do."""

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_resume_refuses_a_checkpoint_that_would_run_code(target_dir, data, tmp_path):
    Trainer(_cfg(target_dir, data, tmp_path / "x", steps=2)).run()
    path = tmp_path / "x" / CHECKPOINT
    state = load_state(path)  # our own state loads with weights_only
    assert {"model", "opt", "sched", "rng", "torch_rng"} <= set(state)
    evil = _RunsCode()
    evil.marker = tmp_path / "ran"
    torch.save(state | {"log": evil}, path)
    with pytest.raises(DFlashDataError, match="refused.*could run code.*Fix"):
        Trainer(_cfg(target_dir, data, tmp_path / "x", steps=2, resume=True))
    assert not (tmp_path / "ran").exists()


def test_resume_refuses_a_checkpoint_of_the_older_format(target_dir, data, tmp_path):
    Trainer(_cfg(target_dir, data, tmp_path / "old", steps=2)).run()
    path = tmp_path / "old" / CHECKPOINT
    state = load_state(path)
    del state["format"]  # format 1 had no such key
    torch.save(state, path)
    with pytest.raises(DFlashConfigError, match="older vllm-dflash.*format 1.*Fix"):
        Trainer(_cfg(target_dir, data, tmp_path / "old", steps=2, resume=True))


@pytest.mark.parametrize("bad", ["../outside.npy", "/tmp/outside.npy", 7])
def test_feature_shards_must_stay_in_their_directory(tmp_path, bad):
    import numpy as np

    (tmp_path / "feats").mkdir()
    np.save(tmp_path / "outside.npy", np.zeros((2, 3), dtype=np.float32))
    np.save(tmp_path / "feats" / "features-00000.npy", np.zeros((2, 3), dtype=np.float32))
    index = {"layers": [1], "shards": ["features-00000.npy", bad], "samples": {}}
    (tmp_path / "feats" / "index.json").write_text(json.dumps(index))
    with pytest.raises(DFlashDataError, match=r"shards\[1\] = .*Fix"):
        OfflineFeatures(tmp_path / "feats")


def test_offline_features_equal_online(target, target_dir, data, tmp_path, capsys):
    cfg = _cfg(target_dir, data, tmp_path / "on", steps=3)
    online = Trainer(cfg)
    samples = [(s.id, s.ids) for s in online.samples]
    feats_dir = capture(target_dir, samples, online.layers, tmp_path / "feats", dtype="float32")
    tokens = sum(len(ids) for _, ids in samples)
    size = tokens * 5 * 64 * 4
    printed = capsys.readouterr().out
    assert f"{tokens} tokens x 5 layers x 64 x 4 B = {size / 2**20:.1f} MiB" in printed
    offline_store = OfflineFeatures(feats_dir)
    for sid, ids in samples[:5]:
        ref = target_features(target.model, torch.tensor([ids]), online.layers)[0]
        torch.testing.assert_close(offline_store.get(sid), ref, atol=1e-5, rtol=1e-5)
    offline = Trainer(_cfg(target_dir, data, tmp_path / "off", steps=3, features=feats_dir))
    for _ in range(3):
        a, _ = online.train_step()
        b, _ = offline.train_step()
        assert a == pytest.approx(b, rel=1e-4)


def test_offline_features_must_match_the_layers(target_dir, data, tmp_path):
    tr = Trainer(_cfg(target_dir, data, tmp_path / "on", steps=1))
    feats = capture(target_dir, [(s.id, s.ids) for s in tr.samples], [1, 2], tmp_path / "f")
    with pytest.raises(DFlashDataError, match=r"target layers \[1, 2\]"):
        Trainer(_cfg(target_dir, data, tmp_path / "off", features=feats))


def test_options_run(target_dir, data, tmp_path):
    """bf16 autocast, gradient accumulation, grid anchors, no decay, 1 feature layer."""
    tr = Trainer(
        _cfg(
            target_dir,
            data,
            tmp_path / "o",
            steps=2,
            dtype="bf16",
            grad_accum=2,
            anchors="grid",
            loss_decay=False,
            num_feature_layers=1,
        )
    )
    assert torch.equal(tr.weights, torch.ones(7)) and tr.layers == [4]
    loss, _ = tr.train_step()
    assert 0 < loss < 20


def test_incompatible_drafter_fails_before_training(target_dir, data, tmp_path):
    other = make_target(tmp_path / "other", hidden_size=96, num_heads=3, num_kv_heads=1)
    foreign = make_drafter(tmp_path / "foreign", other)
    with pytest.raises(DFlashConfigError, match="hidden_size"):
        Trainer(_cfg(target_dir, data, tmp_path / "x", init_from=foreign))
    with pytest.raises(DFlashConfigError, match="target_layer_ids"):
        Trainer(_cfg(target_dir, data, tmp_path / "x", target_layer_ids=[1, 9]))
    with pytest.raises(DFlashConfigError, match="too shallow"):
        Trainer(_cfg(target_dir, data, tmp_path / "x", num_feature_layers=8))
    with pytest.raises(DFlashConfigError, match="needs a GPU"):
        Trainer(_cfg(target_dir, data, tmp_path / "x", attention="flex"))
    assert not (tmp_path / "x").exists(), "nothing written before the checks pass"


def test_config_errors_name_the_field(target_dir, data, tmp_path):
    with pytest.raises(DFlashConfigError, match="field 'block_sise'"):
        _cfg(target_dir, data, tmp_path, block_sise=8)
    with pytest.raises(DFlashConfigError, match="field 'lr'"):
        _cfg(target_dir, data, tmp_path, lr=-1)


def test_eval_prompts_outside_the_vocabulary_are_refused(target_dir, data, tmp_path):
    bad = tmp_path / "held_out.jsonl"
    bad.write_text(json.dumps({"prompt_token_ids": [5, 6, 4096]}) + "\n")
    samples, _ = data
    cfg = _cfg(target_dir, (samples, bad), tmp_path / "run", steps=1, strict=True)
    with pytest.raises(DFlashDataError, match=r"line 1: .*4096: outside the target's vocabulary"):
        Trainer(cfg)


def test_mixed_block_sizes_label_short_blocks_only_up_to_their_length(target_dir, data, tmp_path):
    """train_block_sizes [4, 8] on a block-8 drafter: slots 4..7 are labelled in about half
    the blocks that label slots 1..3 (the length-4 ones stop at slot 3); [8] alone is the
    unset run, loss for loss."""
    mixed = Trainer(_cfg(target_dir, data, tmp_path / "m", steps=1, train_block_sizes=[4, 8]))
    torch.manual_seed(0)
    sums = [mixed.batch_loss(mixed._next_batch()) for _ in range(6)]
    labelled = torch.stack([s.labelled for s in sums]).sum(0)  # [7] labels per slot
    short_share = 1 - labelled[3:].mean() / labelled[:3].mean()
    assert 0.35 < short_share < 0.65, labelled.tolist()
    only4 = Trainer(_cfg(target_dir, data, tmp_path / "4", steps=1, train_block_sizes=[4]))
    sums = only4.batch_loss(only4._next_batch())
    assert sums.labelled[3:].sum() == 0 < sums.labelled[:3].sum()
    same = Trainer(_cfg(target_dir, data, tmp_path / "s", steps=3, train_block_sizes=[8]))
    unset = Trainer(_cfg(target_dir, data, tmp_path / "u", steps=3))
    same.run()
    unset.run()
    assert same.log["loss"] == unset.log["loss"]


def test_train_block_sizes_are_checked(target_dir, data, tmp_path):
    with pytest.raises(DFlashConfigError, match="field 'train_block_sizes'.*block_size 8"):
        Trainer(_cfg(target_dir, data, tmp_path / "x", train_block_sizes=[8, 16]))
    with pytest.raises(DFlashConfigError, match="field 'train_block_sizes'.*>= 2"):
        _cfg(target_dir, data, tmp_path / "x", train_block_sizes=[1, 8])
    assert not (tmp_path / "x").exists()
