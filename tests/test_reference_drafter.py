"""The reference drafter against an independent, per-head re-derivation of the drafter
(docs/architecture.md §1)."""

from __future__ import annotations

import math

import torch
from oracles import GreedyOracleDrafter

from vllm_dflash.reference.generate import spec_generate


def _rms(x, w, eps=1e-6):
    return w * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _rotate(x, pos, theta):
    """RoPE written pair by pair: dims i and i + d/2 rotate by pos * theta^(-2i/d)."""
    d = x.shape[-1]
    out = x.clone()
    for i in range(d // 2):
        ang = pos.double() * theta ** (-2 * i / d)
        c, s = torch.cos(ang).to(x.dtype), torch.sin(ang).to(x.dtype)
        out[:, i] = x[:, i] * c - x[:, i + d // 2] * s
        out[:, i + d // 2] = x[:, i + d // 2] * c + x[:, i] * s
    return out


def naive_draft_logits(drafter, features, block_ids, start):
    """Everything recomputed from all T context features in one pass, no cache, no batching."""
    m, cfg, tgt = drafter.model, drafter.cfg, drafter.target
    d, nh, nkv, theta = (
        cfg.resolved_head_dim,
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.resolved_rope_theta,
    )
    ctx = _rms(features @ m.fc.weight.T, m.hidden_norm.weight)
    x = tgt.embed(block_ids)
    t, b = features.shape[0], block_ids.shape[0]
    pos_ctx, pos_blk = torch.arange(t), torch.arange(start, start + b)
    for layer in m.layers:
        a = layer.self_attn
        hx = _rms(x, layer.input_layernorm.weight)
        src = torch.cat([ctx, hx])  # same k/v projections for context and block
        heads = []
        for h in range(nh):
            g = h // (nh // nkv)
            q = (hx @ a.q_proj.weight.T)[:, h * d : (h + 1) * d]
            q = _rotate(_rms(q, a.q_norm.weight), pos_blk, theta)
            k = (src @ a.k_proj.weight.T)[:, g * d : (g + 1) * d]
            k = _rotate(_rms(k, a.k_norm.weight), torch.cat([pos_ctx, pos_blk]), theta)
            v = (src @ a.v_proj.weight.T)[:, g * d : (g + 1) * d]
            heads.append(torch.softmax(q @ k.T / math.sqrt(d), dim=-1) @ v)  # no mask
        x = x + torch.cat(heads, -1) @ a.o_proj.weight.T
        y = _rms(x, layer.post_attention_layernorm.weight)
        mlp = layer.mlp
        gate = torch.nn.functional.silu(y @ mlp.gate_proj.weight.T)
        x = x + (gate * (y @ mlp.up_proj.weight.T)) @ mlp.down_proj.weight.T
    return tgt.lm_head(_rms(x, m.norm.weight))[1:]


def _features(target, ids, layers):
    target.reset()
    _, feats = target.forward(ids, layers)
    return feats


def test_incremental_cache_matches_one_shot(drafters, target):
    drafter = drafters[8]
    ids = list(range(3, 23))
    feats = _features(target, ids, drafter.feature_layers)
    anchor = 42
    drafter.reset()
    # Commit in uneven chunks, as verification does (prefill, then m+1 rows per step).
    for lo, hi in [(0, 11), (11, 14), (14, 15), (15, 20)]:
        got = drafter.draft_logits(feats[lo:hi], anchor, hi, ids[:hi])
    block = torch.tensor([anchor] + [drafter.cfg.mask_token_id] * 7)
    want = naive_draft_logits(drafter, feats, block, start=20)
    assert got.shape == (7, 128)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    assert drafter.cache.length == 20  # anchor and masks never committed


def _block_outputs(drafter, feats, block_ids, ctx_kv=None):
    """The production model's block hidden states [s, h] for a block at position 10."""
    m = drafter.model
    positions = torch.arange(10, 10 + len(block_ids))[None]
    if ctx_kv is None:
        ctx_kv = m.context_kv(feats[None], torch.arange(feats.shape[0])[None])
    embeds = drafter.target.embed(torch.tensor([block_ids]))
    return m.forward_block(embeds, positions, ctx_kv)[0]


def test_block_attention_is_bidirectional(drafters, target):
    drafter = drafters[4]
    feats = _features(target, list(range(5, 15)), drafter.feature_layers)
    base = _block_outputs(drafter, feats, [7, 127, 127, 127])
    changed = _block_outputs(drafter, feats, [7, 127, 127, 9])
    # Slot 1 sees slot 3: a causal block would leave its output unchanged.
    assert not torch.allclose(base[1], changed[1])


def test_every_layer_attends_to_its_own_context_kv(drafters, target):
    drafter = drafters[4]
    feats = _features(target, list(range(5, 15)), drafter.feature_layers)
    ctx_kv = drafter.model.context_kv(feats[None], torch.arange(10)[None])
    base = _block_outputs(drafter, feats, [7, 127, 127, 127], ctx_kv)
    for layer in range(len(ctx_kv)):
        k, v = ctx_kv[layer]
        perturbed = list(ctx_kv)
        perturbed[layer] = (k, v + 1.0)  # change only this layer's context values
        out = _block_outputs(drafter, feats, [7, 127, 127, 127], perturbed)
        assert not torch.allclose(base, out), f"layer {layer} ignores its context K/V"


class _Recording:
    """Runs the real drafter (so its cache commits what the loop passes) but proposes the
    oracle's tokens, so steps with m > 0 happen; records every call."""

    def __init__(self, inner, oracle):
        self.inner, self.oracle, self.block_size = inner, oracle, inner.block_size
        self.feature_layers = inner.feature_layers
        self.calls, self.features = [], []

    def reset(self):
        self.inner.reset()

    def draft_logits(self, new_features, anchor_token, anchor_position, verified_tokens):
        before = self.inner.cache.length
        self.inner.draft_logits(new_features, anchor_token, anchor_position, verified_tokens)
        self.calls.append((before, self.inner.cache.length, anchor_position))
        self.features.append(new_features.clone())
        return self.oracle.draft_logits(
            new_features, anchor_token, anchor_position, verified_tokens
        )


def test_caches_commit_exactly_the_verified_positions(drafters, target):
    oracle = GreedyOracleDrafter(target.model, 8, accuracy=0.8)
    rec = _Recording(drafters[8], oracle)
    prompt = list(range(10, 30))
    res = spec_generate(target, rec, prompt, max_new_tokens=40)
    assert res.num_steps == len(rec.calls) >= 5 and max(res.accepted) >= 3
    for i, (before, after, anchor_pos) in enumerate(rec.calls):
        assert after == anchor_pos  # every verified position, nothing more
        if i:
            assert before == rec.calls[i - 1][1]
            assert after - before == res.accepted[i - 1] + 1
    assert rec.calls[0] == (0, len(prompt), len(prompt))
    # The rows committed are the target's features of exactly those positions, in order.
    committed = torch.cat(rec.features)
    sequence = prompt + res.tokens[:-1]
    want = _features(target, sequence[: committed.shape[0]], drafters[8].feature_layers)
    torch.testing.assert_close(committed, want, atol=1e-5, rtol=1e-4)
