"""The DFlash drafter as a vLLM model over vLLM's paged KV cache.

vLLM instantiates this class for the ``DFlashDraftModel`` architecture once our plugin has
registered it. Each drafter layer owns a vLLM ``Attention`` layer, so its K/V blocks come
from vLLM's KV-cache manager like the target's.

Per decoding step our proposer (runner V1) or vLLM's runner-V2 DFlash orchestration (our
speculator, ``v2/speculator.py``) drives it through the same three methods, the interface
runner V2 defines for DFlash drafters:

* ``combine_hidden_states(features)``: the target's concatenated hidden states ->
  ``fc`` -> ``hidden_norm``: one fused context row per position.
* ``precompute_and_store_context_kv(context, positions, slots)``: every layer's k/v
  projection of those rows (one GEMM for all layers) -> ``k_norm`` -> RoPE -> paged-cache
  write at ``slots`` (-1: skip the row); after the GEMM, one fused op (``context_kv.py``,
  csrc/) where it is built. This is the only place context K/V is produced; it is never
  recomputed.
* ``forward(input_ids, positions)``: the block (anchor + masks) runs through the layers;
  its queries attend to the cached context plus the block itself with no causal mask (the
  attention metadata says ``causal=False``). The block's own K/V lands in the cache at the
  block's positions and is overwritten by real context K/V before anything reads it again.

CUDA graphs: runner V2 captures the context write and the forward in one graph. Both read
only their arguments, persistent weights and the forward context, have static shapes per
padded token count, never synchronise with the host and allocate nothing that outlives the
call. Every one-time decision (which context-K/V path, the RoPE tables in the model's dtype)
is made at load (``load_weights``) or by ``bind_kv_cache``, which the speculator calls
before capture.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from vllm.config import VllmConfig, get_current_vllm_config
from vllm.model_executor.layers.activation import SiluAndMul
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.model_loader.weight_utils import default_weight_loader

from vllm_dflash import ops
from vllm_dflash.config import DrafterConfig
from vllm_dflash.serving.context_kv import ContextKvWriter
from vllm_dflash.serving.drafter_config import drafter_config_of
from vllm_dflash.serving.v2.config import speculator_config_class

# Checkpoint names of the separate q/k/v and gate/up projections -> our fused parameters.
_STACKED = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class RMSNorm(nn.Module):
    """RMSNorm as one ATen op. vLLM's own RMSNorm costs ~35 us per call on CPU in eager mode
    (it dispatches through vLLM's op IR) against ~12 us here, and the drafter calls it
    4 times per layer per step. Same parameter name (``weight``) as the checkpoint."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """``norm(x)``, or with ``residual``: ``(norm(x + residual), x + residual)``."""
        if residual is None:
            return nn.functional.rms_norm(x, self.weight.shape, self.weight, self.eps)
        x = x + residual
        return nn.functional.rms_norm(x, self.weight.shape, self.weight, self.eps), x


class DrafterAttention(nn.Module):
    def __init__(self, cfg: DrafterConfig, prefix: str) -> None:
        super().__init__()
        hd = cfg.resolved_head_dim
        self.head_dim = hd
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size,
            hd,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            bias=cfg.attention_bias,
            prefix=f"{prefix}.qkv_proj",
        )
        self.o_proj = RowParallelLinear(
            cfg.num_attention_heads * hd,
            cfg.hidden_size,
            bias=cfg.attention_bias,
            prefix=f"{prefix}.o_proj",
        )
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.num_heads * hd, self.num_kv_heads * hd
        self.q_norm = RMSNorm(hd, eps=cfg.rms_norm_eps)
        self.k_norm = RMSNorm(hd, eps=cfg.rms_norm_eps)
        self.rotary_emb = get_rope(
            hd,
            max_position=cfg.max_position_embeddings,
            rope_parameters={"rope_type": "default", "rope_theta": cfg.resolved_rope_theta},
        )
        # RoPE table in the model's dtype for the compiled qk_norm_rope op; set after the
        # weights are loaded when the op serves this device (None: the PyTorch path).
        self._cos_sin: torch.Tensor | None = None
        vllm_config = get_current_vllm_config()
        self.attn = Attention(
            self.num_heads,
            hd,
            hd**-0.5,
            num_kv_heads=self.num_kv_heads,
            cache_config=vllm_config.cache_config,
            prefix=f"{prefix}.attn",
        )

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        qkv, _ = self.qkv_proj(x)
        if self._cos_sin is not None:  # q_norm, k_norm and RoPE in one op, in place
            torch.ops.vllm_dflash.qk_norm_rope(
                qkv,
                self.q_norm.weight,
                self.k_norm.weight,
                self.q_norm.eps,
                positions,
                self._cos_sin,
                self.rotary_emb.is_neox_style,
                self.num_heads,
                self.num_kv_heads,
            )
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        else:
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            n, hd = x.shape[0], self.head_dim
            q = self.q_norm(q.reshape(n, -1, hd)).reshape(n, self.q_size)
            k = self.k_norm(k.reshape(n, -1, hd)).reshape(n, self.kv_size)
            q, k = self.rotary_emb(positions, q, k)
        out, _ = self.o_proj(self.attn(q, k, v))
        return out


class DrafterMLP(nn.Module):
    def __init__(self, cfg: DrafterConfig, prefix: str) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            cfg.hidden_size, [cfg.intermediate_size] * 2, bias=False, prefix=f"{prefix}.gate"
        )
        self.down_proj = RowParallelLinear(
            cfg.intermediate_size, cfg.hidden_size, bias=False, prefix=f"{prefix}.down_proj"
        )
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up, _ = self.gate_up_proj(x)
        out, _ = self.down_proj(self.act(gate_up))
        return out


class DrafterLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig, prefix: str) -> None:
        super().__init__()
        self.self_attn = DrafterAttention(cfg, f"{prefix}.self_attn")
        self.mlp = DrafterMLP(cfg, f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class DrafterBody(nn.Module):
    """Holds the layers; the proposer puts the target's ``embed_tokens`` here."""

    def __init__(self, cfg: DrafterConfig, prefix: str) -> None:
        super().__init__()
        self.fc = ReplicatedLinear(cfg.feature_size, cfg.hidden_size, bias=False, prefix="fc")
        self.hidden_norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.layers = nn.ModuleList(
            DrafterLayer(cfg, f"{prefix}.layers.{i}") for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.embed_tokens: nn.Module | None = None  # the target's, shared at load time


class DFlashDraftModel(nn.Module):
    """vLLM model class for ``architectures: ["DFlashDraftModel"]`` (z-lab format)."""

    # The drafter reuses the target's frozen embedding and LM head. vLLM's proposer base
    # (V1) and its runner-V2 loader put the target's modules into ``model.embed_tokens`` and
    # ``lm_head`` at load time (their "shares everything" path, taken because this class
    # declares no ``has_own_embed_tokens`` / ``has_own_lm_head``).

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        self.cfg = drafter_config_of(vllm_config)
        self.config = vllm_config.model_config.hf_config  # vLLM's loaders read it
        # Attention layer names must not collide with the target's ("model.layers.N...").
        self.model = DrafterBody(self.cfg, prefix=f"{prefix}dflash_drafter".lstrip("."))
        self.lm_head: nn.Module | None = None  # the target's, shared at load time
        self.logits_processor = LogitsProcessor(self.cfg.vocab_size)

    # ---- vLLM model interface ---------------------------------------------------------
    def embed_input_ids(self, input_ids: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        residual = None
        for layer in self.model.layers:
            x, residual = layer(positions, x, residual)
        x, _ = self.model.norm(x, residual)
        return x

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits (all-gathered across tensor-parallel ranks)."""
        return self.logits_processor(self.lm_head, hidden_states)

    def get_top_tokens(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Argmax token ids. Under tensor parallelism each rank takes the max of its own
        vocabulary shard and only (value, id) pairs are all-gathered, not the logits."""
        return self.logits_processor.get_top_tokens(self.lm_head, hidden_states)

    # ---- context K/V --------------------------------------------------------------------
    def combine_hidden_states(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[N, len(target_layer_ids) * H_target] target features -> [N, H] drafter
        context (``fc`` -> ``hidden_norm``)."""
        fused, _ = self.model.fc(hidden_states)
        return self.model.hidden_norm(fused)

    def precompute_and_store_context_kv(
        self,
        hidden_states: torch.Tensor,  # [N, H] fused context rows
        positions: torch.Tensor,  # [N] int64
        context_slot_mapping: torch.Tensor | None = None,  # [N] int64, -1 = skip the row
    ) -> None:
        """Project the fused rows to every layer's K/V and write it at the slots (None:
        compute only, as in vLLM's memory-profiling run). Every drafter layer shares one
        KV-cache group, so one slot mapping serves all of them."""
        attn0 = self.model.layers[0].self_attn
        n, L = hidden_states.shape[0], len(self.model.layers)
        kv = nn.functional.linear(hidden_states, self._ctx_kv_weight, self._ctx_kv_bias)
        self._context_kv(
            kv.view(n, L, 2, attn0.num_kv_heads, attn0.head_dim), positions, context_slot_mapping
        )

    def bind_kv_cache(self) -> None:
        """Decide the context-K/V path for the KV cache now bound to the layers (probing
        the attention backend's layout synchronises with the device): call it before CUDA
        graph capture. A later cache (re-allocation) is decided again."""
        self._context_kv.bind(self._ctx_kv_weight.dtype)

    def _stack_context_weights(self) -> None:
        """Stack every layer's k/v rows of ``qkv_proj`` into one matrix (one GEMM per step
        for all layers) and the k_norm weights into one tensor."""
        attns = [layer.self_attn for layer in self.model.layers]
        q = attns[0].q_size
        self._ctx_kv_weight = torch.cat([a.qkv_proj.weight[q:] for a in attns]).clone()
        biases = [a.qkv_proj.bias for a in attns]
        self._ctx_kv_bias = (
            None if biases[0] is None else torch.cat([b[q:] for b in biases]).clone()
        )
        k_norm_weight = torch.stack([a.k_norm.weight for a in attns]).contiguous()
        # k_norm -> RoPE -> paged-cache write: the fused op when it can run (context_kv.py).
        self._context_kv = ContextKvWriter(attns, k_norm_weight, attns[0].k_norm.eps)
        weight = self._ctx_kv_weight
        if ops.has_kernel(weight.device):  # q_norm, k_norm and RoPE in one op per layer
            for a in attns:
                a._cos_sin = a.rotary_emb.cos_sin_cache.to(weight).contiguous()

    # ---- weights ------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if name.startswith(("embed_tokens.", "lm_head.", "model.embed_tokens.")):
                continue  # the target's are used; a copy in the checkpoint is ignored
            name = "model." + name.removeprefix("model.")
            parts = name.split(".")
            stacked = _STACKED.get(parts[-2]) if len(parts) >= 2 else None
            if stacked is not None:
                fused, shard = stacked
                name = ".".join([*parts[:-2], fused, parts[-1]])
                params[name].weight_loader(params[name], tensor, shard)
            else:
                param = params[name]
                getattr(param, "weight_loader", default_weight_loader)(param, tensor)
            loaded.add(name)
        # Now, while the weights are plain tensors: vLLM's CPU linear layers repack theirs
        # into a backend format after loading.
        self._stack_context_weights()
        return loaded


# vLLM 0.34 builds the runner-V2 speculator the draft model class names (seam
# v2.speculator_config); before 0.34 there is no such seam and install.py wires it in.
if (_speculator_config := speculator_config_class()) is not None:
    DFlashDraftModel.speculator_config_class = _speculator_config  # type: ignore[attr-defined]
