"""Anchor sampling, block inputs and the training attention mask (dense and flex)."""

from __future__ import annotations

import random

import pytest
import torch

from vllm_dflash.reference.model import DFlashDrafter
from vllm_dflash.train import blocks
from vllm_dflash.train.drafter_init import new_drafter_config

# A tiny Qwen3 target config, enough to size a drafter.
TINY_TARGET = {
    "num_hidden_layers": 8,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "vocab_size": 50,
    "max_position_embeddings": 512,
}


@pytest.mark.parametrize("mode", ["random", "grid"])
def test_anchors_lie_in_the_response_and_have_labels(mode):
    rng = random.Random(0)
    for _ in range(200):
        p, length, block = rng.randint(1, 30), rng.randint(2, 90), rng.choice([4, 8, 16])
        n = rng.randint(1, 20)
        a = blocks.sample_anchors(rng, p, length, block, n, mode)
        assert a == sorted(set(a)), "distinct and sorted"
        assert all(p <= x <= length - 2 for x in a), (p, length, a)
        room = max(0, length - 1 - p)
        cap = room if mode == "random" else -(-room // block)
        assert len(a) == min(n, cap)
        if mode == "grid":
            assert all((x - p) % block == 0 for x in a)


def test_random_anchors_reach_every_response_position():
    rng = random.Random(1)
    seen = set()
    for _ in range(300):
        seen |= set(blocks.sample_anchors(rng, 5, 40, 8, 4, "random"))
    assert seen == set(range(5, 39))


def test_block_inputs():
    seqs = torch.arange(100, 120)[None].repeat(2, 1)  # token at position i is 100 + i
    anchors = torch.tensor([[3, 15], [16, -1]])
    full = torch.tensor([20, 20])
    ids, pos, labels = blocks.block_inputs(seqs, full, anchors, 4, mask_id=7)
    assert ids.tolist() == [[103, 7, 7, 7, 115, 7, 7, 7], [116, 7, 7, 7, 100, 7, 7, 7]]
    assert pos[0].tolist() == [3, 4, 5, 6, 15, 16, 17, 18]
    assert labels[0].tolist() == [[104, 105, 106], [116, 117, 118]]
    # past the end of the sequence (length 20) and a padding block: ignored
    assert labels[1].tolist() == [[117, 118, 119], [-100, -100, -100]]
    short = blocks.block_inputs(
        seqs[:, :18], torch.tensor([18, 18]), torch.tensor([[15]]).repeat(2, 1), 4, 7
    )[2]
    assert short[0].tolist() == [[116, 117, -100]]


def test_padding_of_a_shorter_sequence_is_never_a_label():
    """In a batch padded to its longest sequence, a block near the end of a shorter one
    labels only that sequence's own tokens (the pad id would otherwise be trained)."""
    seqs = torch.arange(100, 120)[None].repeat(2, 1)
    seqs[1, 12:] = 0  # the second sequence has 12 tokens, then padding
    anchors = torch.tensor([[9], [9]])
    labels = blocks.block_inputs(seqs, torch.tensor([20, 12]), anchors, 4, 7)[2]
    assert labels.tolist() == [[[110, 111, 112]], [[110, 111, -100]]]


def _brute_force_mask(anchors: list[list[int]], ctx_len: int, block: int) -> torch.Tensor:
    b, n = len(anchors), len(anchors[0])
    m = torch.zeros(b, 1, n * block, ctx_len + n * block, dtype=torch.bool)
    for s in range(b):
        for q in range(n * block):
            for kv in range(ctx_len + n * block):
                if kv < ctx_len:
                    m[s, 0, q, kv] = kv < anchors[s][q // block]
                else:
                    m[s, 0, q, kv] = (kv - ctx_len) // block == q // block
    return m


def test_dense_mask_matches_brute_force():
    anchors = [[2, 9, 17], [0, 5, -1]]
    got = blocks.dense_block_mask(torch.tensor(anchors), 20, 4)
    assert torch.equal(got, _brute_force_mask(anchors, 20, 4))


def test_flex_mask_mod_matches_brute_force():
    anchors = [[2, 9, 17], [0, 5, -1]]
    bm = blocks.flex_block_mask(torch.tensor(anchors), 20, 4)
    q = torch.arange(12)[:, None]
    kv = torch.arange(32)[None, :]
    for s in range(2):
        got = bm.mask_mod(torch.tensor(s), torch.tensor(0), q, kv)
        assert torch.equal(got, _brute_force_mask(anchors, 20, 4)[s, 0])


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("block", [4, 8])
def test_flex_and_dense_drafter_forward_agree(block):
    """The same blocks through the drafter with either mask: equal outputs."""
    cfg = new_drafter_config(TINY_TARGET, block_size=block, num_layers=2, num_feature_layers=3)
    torch.manual_seed(0)
    model = DFlashDrafter(cfg).eval()
    b, T, n = 2, 40, 3
    anchors = torch.tensor([[4, 11, 30], [7, 20, -1]])
    feats = torch.randn(b, T, cfg.feature_size)
    ctx_kv = model.context_kv(feats, torch.arange(T).expand(b, T))
    embeds = torch.randn(b, n * block, cfg.hidden_size)
    pos = (anchors.clamp(min=0)[:, :, None] + torch.arange(block)).view(b, -1)
    with torch.no_grad():
        dense = model.forward_block(
            embeds, pos, ctx_kv, attn_mask=blocks.dense_block_mask(anchors, T, block)
        )
        flex = model.forward_block(
            embeds, pos, ctx_kv, attn_mask=blocks.flex_block_mask(anchors, T, block)
        )
    torch.testing.assert_close(flex, dense, atol=2e-5, rtol=1e-4)


def test_blocks_are_isolated_and_see_only_their_context():
    """Changing a token in one block, or context at/after its anchor, leaves the other
    block's output unchanged (the mask is not only well-formed but effective)."""
    cfg = new_drafter_config(TINY_TARGET, block_size=4, num_layers=2, num_feature_layers=3)
    torch.manual_seed(0)
    model = DFlashDrafter(cfg).eval()
    T, anchors = 30, torch.tensor([[5, 20]])
    feats = torch.randn(1, T, cfg.feature_size)
    embeds = torch.randn(1, 8, cfg.hidden_size)
    pos = (anchors[:, :, None] + torch.arange(4)).view(1, -1)
    mask = blocks.dense_block_mask(anchors, T, 4)

    def run(f, e):
        ctx_kv = model.context_kv(f, torch.arange(T)[None])
        with torch.no_grad():
            return model.forward_block(e, pos, ctx_kv, attn_mask=mask)

    base = run(feats, embeds)
    e2 = embeds.clone()
    e2[0, 5] += 1.0  # a token of block 1
    f2 = feats.clone()
    f2[0, 5:] += 1.0  # context from block 0's anchor on
    out = run(f2, e2)
    torch.testing.assert_close(out[0, :4], base[0, :4])
    assert not torch.allclose(out[0, 4:], base[0, 4:])


def test_many_blocks_in_one_forward_equal_drafting_each_alone():
    """Training sees what serving sees: every block of the masked multi-block forward equals
    the drafter run on that block alone, with the context K/V of positions < its anchor and
    no mask (the reference engine's drafting step)."""
    block = 8
    cfg = new_drafter_config(TINY_TARGET, block_size=block, num_layers=2, num_feature_layers=3)
    torch.manual_seed(0)
    model = DFlashDrafter(cfg).eval()
    T = 60
    seqs = torch.randint(0, 49, (1, T))
    anchors = torch.tensor([[3, 17, 18, 40, 58]])
    ids, pos, _ = blocks.block_inputs(seqs, torch.tensor([T]), anchors, block, mask_id=49)
    emb = torch.nn.Embedding(50, 64)
    feats = torch.randn(1, T, cfg.feature_size)
    with torch.no_grad():
        ctx_kv = model.context_kv(feats, torch.arange(T)[None])
        mask = blocks.dense_block_mask(anchors, T, block)
        together = model.forward_block(emb(ids), pos, ctx_kv, attn_mask=mask)
        for i, a in enumerate(anchors[0].tolist()):
            alone_kv = model.context_kv(feats[:, :a], torch.arange(a)[None])
            sl = slice(i * block, (i + 1) * block)
            alone = model.forward_block(emb(ids[:, sl]), pos[:, sl], alone_kv)
            torch.testing.assert_close(together[:, sl], alone, atol=1e-5, rtol=1e-5)


def _brute_force_short_mask(anchors, lens, ctx_len: int, block: int) -> torch.Tensor:
    m = _brute_force_mask(anchors, ctx_len, block)
    for s in range(len(anchors)):
        for kv in range(ctx_len, m.shape[-1]):
            slot = kv - ctx_len
            if slot % block >= lens[s][slot // block]:
                m[s, 0, :, kv] = False
    return m


def test_short_blocks_hide_their_missing_slots_in_both_masks():
    anchors, lens = [[2, 9, 17], [0, 5, -1]], [[4, 2, 3], [3, 4, 4]]
    want = _brute_force_short_mask(anchors, lens, 20, 4)
    got = blocks.dense_block_mask(torch.tensor(anchors), 20, 4, torch.tensor(lens))
    assert torch.equal(got, want)
    bm = blocks.flex_block_mask(torch.tensor(anchors), 20, 4, torch.tensor(lens))
    q, kv = torch.arange(12)[:, None], torch.arange(32)[None, :]
    for s in range(2):
        assert torch.equal(bm.mask_mod(torch.tensor(s), torch.tensor(0), q, kv), want[s, 0])


def test_short_blocks_label_only_their_own_slots():
    seqs = torch.arange(100, 120)[None]
    anchors, lens = torch.tensor([[3, 10]]), torch.tensor([[2, 4]])
    labels = blocks.block_inputs(seqs, torch.tensor([20]), anchors, 4, 7, lens)[2]
    assert labels.tolist() == [[[104, -100, -100], [111, 112, 113]]]


def test_a_short_block_in_the_long_layout_equals_drafting_the_short_block():
    """A block-16 drafter trained on length-8 blocks learns what serving with 7 speculative
    tokens computes: the first 8 slots of a length-8 block in the 16-slot layout equal the
    drafter run on an 8-slot block alone, and the long blocks beside it are unchanged."""
    block, short = 16, 8
    cfg = new_drafter_config(TINY_TARGET, block_size=block, num_layers=2, num_feature_layers=3)
    torch.manual_seed(0)
    model = DFlashDrafter(cfg).eval()
    T = 70
    seqs = torch.randint(0, 49, (1, T))
    anchors, lens = torch.tensor([[5, 30, 50]]), torch.tensor([[short, block, short]])
    ids, pos, _ = blocks.block_inputs(seqs, torch.tensor([T]), anchors, block, 49, lens)
    emb = torch.nn.Embedding(50, 64)
    feats = torch.randn(1, T, cfg.feature_size)
    with torch.no_grad():
        ctx_kv = model.context_kv(feats, torch.arange(T)[None])
        mask = blocks.dense_block_mask(anchors, T, block, lens)
        together = model.forward_block(emb(ids), pos, ctx_kv, attn_mask=mask)
        for i, (a, n) in enumerate(zip(anchors[0].tolist(), lens[0].tolist(), strict=True)):
            alone_kv = model.context_kv(feats[:, :a], torch.arange(a)[None])
            sl = slice(i * block, i * block + n)
            alone = model.forward_block(emb(ids[:, sl]), pos[:, sl], alone_kv)
            torch.testing.assert_close(together[:, sl], alone, atol=1e-5, rtol=1e-5)
    # and without the lengths the short blocks' slots would see all 15 masks: different
    with torch.no_grad():
        full = model.forward_block(
            emb(ids), pos, ctx_kv, attn_mask=blocks.dense_block_mask(anchors, T, block)
        )
    assert not torch.allclose(full[:, :short], together[:, :short], atol=1e-4)
