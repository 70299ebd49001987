"""The shapes the GPU check runs at: the Qwen3-8B-DFlash-b16 drafter, and a tiny set for the
dry run. Each set also carries its workload (requests, context length, batch sizes, draft
lengths), so the dry run differs from the GPU run by parameters only, never by code path."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

DFLASH_ARCHITECTURE = "DFlashDraftModel"  # same string as vllm_dflash.config (pydantic-free)


@dataclass(frozen=True)
class ShapeSet:
    name: str
    # Drafter (a Qwen3-style stack; its config.json fields).
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    num_drafter_layers: int
    block_size: int  # anchor + (block_size - 1) mask positions
    vocab_size: int
    rope_theta: float
    rms_norm_eps: float
    # Target whose hidden states the drafter fuses.
    num_target_layers: int
    target_hidden_size: int
    target_layer_ids: tuple[int, ...]
    # Workload of part (a): context rows = requests * block_size, positions < max_position.
    requests: int
    max_position: int
    # Workload of part (b): context per request, batch sizes, draft lengths (draft_len).
    context_len: int
    batch_sizes: tuple[int, ...]
    draft_lens: tuple[int, ...]

    @property
    def feature_size(self) -> int:
        """Width of one position's concatenated target features (fc's input)."""
        return len(self.target_layer_ids) * self.target_hidden_size

    @property
    def num_speculative_tokens(self) -> int:
        return self.block_size - 1

    @property
    def context_rows(self) -> int:
        """Rows of one inject_context_kv call: every request commits a block's worth."""
        return self.requests * self.block_size

    @property
    def qkv_width(self) -> int:
        """Width of the fused qkv rows qk_norm_rope works on."""
        return (self.num_attention_heads + 2 * self.num_key_value_heads) * self.head_dim

    def problems(self) -> list[str]:
        """Every way the set contradicts itself (empty when consistent)."""
        out = []
        if self.num_attention_heads % self.num_key_value_heads:
            out.append(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.num_attention_heads * self.head_dim != self.hidden_size:
            out.append(
                f"num_attention_heads * head_dim = {self.num_attention_heads * self.head_dim} "
                f"!= hidden_size={self.hidden_size}"
            )
        if self.head_dim % 2:
            out.append(f"head_dim={self.head_dim} must be even for RoPE")
        if len(self.target_layer_ids) != self.num_drafter_layers:
            out.append(
                f"{len(self.target_layer_ids)} target layers for {self.num_drafter_layers} "
                "drafter layers (z-lab drafters fuse one target layer per drafter layer)"
            )
        ids = self.target_layer_ids
        if list(ids) != sorted(set(ids)) or min(ids) < 0 or max(ids) > self.num_target_layers - 2:
            out.append(
                f"target_layer_ids={ids} must be strictly increasing in "
                f"[0, {self.num_target_layers - 2}]"
            )
        if (
            not self.draft_lens
            or max(self.draft_lens) > self.num_speculative_tokens
            or min(self.draft_lens) < 1
        ):
            out.append(
                f"draft_lens={self.draft_lens} must lie in [1, {self.num_speculative_tokens}]"
            )
        if self.context_len + self.block_size > self.max_position:
            out.append(f"context_len + block_size > max_position={self.max_position}")
        return out

    def drafter_config_dict(self) -> dict[str, Any]:
        """The drafter's config.json (z-lab format), for vllm_dflash.config.DrafterConfig."""
        return {
            "architectures": [DFLASH_ARCHITECTURE],
            "model_type": "qwen3",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_drafter_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position,
            "block_size": self.block_size,
            "num_target_layers": self.num_target_layers,
            "target_hidden_size": self.target_hidden_size,
            "dflash_config": {
                "mask_token_id": self.vocab_size - 1,
                "target_layer_ids": list(self.target_layer_ids),
            },
        }


# z-lab/Qwen3-8B-DFlash-b16: 5 drafter layers over a 36-layer Qwen3-8B target, fusing target
# layers 1, 9, 17, 25, 33 (the uniform rule of vllm_dflash.config.default_target_layer_ids).
QWEN3_8B_B16 = ShapeSet(
    name="qwen3-8b-dflash-b16",
    hidden_size=4096,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    intermediate_size=12288,
    num_drafter_layers=5,
    block_size=16,
    vocab_size=151936,
    rope_theta=1e6,
    rms_norm_eps=1e-6,
    num_target_layers=36,
    target_hidden_size=4096,
    target_layer_ids=(1, 9, 17, 25, 33),
    requests=32,
    max_position=40960,
    context_len=1024,
    batch_sizes=(1, 8, 32),
    draft_lens=(1, 2, 4, 8, 15),
)

# Same structure (GQA 2:1, several layers, block crossing), small enough for a CPU in seconds.
TINY = ShapeSet(
    name="tiny",
    hidden_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    intermediate_size=256,
    num_drafter_layers=2,
    block_size=8,
    vocab_size=512,
    rope_theta=1e6,
    rms_norm_eps=1e-6,
    num_target_layers=8,
    target_hidden_size=128,
    target_layer_ids=(1, 5),
    requests=4,
    max_position=4096,
    context_len=64,
    batch_sizes=(1, 2),
    draft_lens=(1, 2),
)
