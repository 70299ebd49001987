"""What our V1 proposer and V2 speculator both check and set up when vLLM builds them."""

from __future__ import annotations

import logging
from typing import Any

import torch

from vllm_dflash.config import DrafterConfig
from vllm_dflash.errors import DFlashConfigError
from vllm_dflash.serving.drafter_config import check_serving_config
from vllm_dflash.serving.seams import resolve

logger = logging.getLogger("vllm.plugins.vllm_dflash")


def checked_drafter(vllm_config: Any) -> DrafterConfig:
    """The drafter config, validated against the target and the parallel layout, before
    vLLM reads anything from it; the target layers the runner captures pinned to it."""
    draft = check_serving_config(vllm_config)
    spec = vllm_config.speculative_config
    # Both runners pick the target layers to capture from this dict (+1: vLLM records the
    # residual stream entering a layer); a missing key would give EAGLE-3's three layers.
    hf = spec.draft_model_config.hf_config
    hf.dflash_config = {
        **(getattr(hf, "dflash_config", None) or {}),
        "target_layer_ids": list(draft.target_layer_ids),
        "mask_token_id": draft.mask_token_id,
    }
    tp = vllm_config.parallel_config.tensor_parallel_size
    if spec.draft_tensor_parallel_size == 1 and tp > 1:
        logger.warning(
            "vllm-dflash: draft_tensor_parallel_size=1 is not honoured: the drafter is "
            "sharded over the target's %d ranks, as vLLM's built-in dflash does too "
            "(docs/tensor-parallel.md). Leave the field out to silence this.",
            tp,
        )
    return draft


def check_target(target_model: torch.nn.Module) -> None:
    if not resolve("target.aux_hidden_states")(target_model):
        raise DFlashConfigError(
            f"target architecture {type(target_model).__name__} cannot return "
            "intermediate hidden states, which DFlash drafts from. Fix: serve a target "
            "whose vLLM model implements SupportsEagle3 (Qwen3, Llama, ...), or drop "
            "--speculative-config"
        )


def check_features(draft: DrafterConfig, shape: tuple[int, ...], num_tokens: int) -> None:
    """Under tensor parallelism every rank must get the full residual stream of every
    target token (the layers' all-reduced output); a shard would draft silently worse.
    ``shape``: the concatenated features' shape. Host integers only: no device sync."""
    if shape[0] < num_tokens or shape[1] != draft.feature_size:
        layers = len(draft.target_layer_ids)
        raise DFlashConfigError(
            f"the target handed the drafter hidden states of shape {list(shape)}, expected "
            f"{[num_tokens, draft.feature_size]} ({num_tokens} tokens x {layers} layers x "
            "hidden_size): this rank got a shard, not the full residual stream. Fix: turn "
            "off whatever option splits the target's hidden states across ranks, or serve "
            "with VLLM_DFLASH_BACKEND=builtin"
        )
