"""A new drafter's config.json, derived from its target's.

The drafter shares the target's embedding and LM head, so hidden size, vocabulary and
attention geometry are copied from the target; only depth, MLP width, block size and the
fused target layers are choices.
"""

from __future__ import annotations

from typing import Any

from vllm_dflash.config import DrafterConfig, default_target_layer_ids


def new_drafter_config(
    target: dict[str, Any],
    *,
    block_size: int,
    num_layers: int,
    num_feature_layers: int = 5,
    target_layer_ids: list[int] | None = None,
    intermediate_size: int | None = None,
    mask_token_id: int | None = None,
) -> DrafterConfig:
    """``target`` is the target's config.json as a dict."""
    layers = target["num_hidden_layers"]
    ids = target_layer_ids or default_target_layer_ids(layers, num_feature_layers)
    heads = target["num_attention_heads"]
    return DrafterConfig.from_dict(
        {
            "architectures": ["DFlashDraftModel"],
            "model_type": "qwen3",
            "hidden_size": target["hidden_size"],
            "intermediate_size": intermediate_size or target["intermediate_size"],
            "num_hidden_layers": num_layers,
            "num_attention_heads": heads,
            "num_key_value_heads": target.get("num_key_value_heads") or heads,
            "head_dim": target.get("head_dim") or target["hidden_size"] // heads,
            "vocab_size": target["vocab_size"],
            "rms_norm_eps": target.get("rms_norm_eps", 1e-6),
            "rope_theta": (target.get("rope_parameters") or {}).get(
                "rope_theta", target.get("rope_theta", 1e6)
            ),
            "max_position_embeddings": target["max_position_embeddings"],
            "tie_word_embeddings": False,
            "block_size": block_size,
            "num_target_layers": layers,
            "dflash_config": {
                "target_layer_ids": ids,
                "mask_token_id": target["vocab_size"] - 1
                if mask_token_id is None
                else mask_token_id,
            },
        },
        source="new drafter config",
    )
