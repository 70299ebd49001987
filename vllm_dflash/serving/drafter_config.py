"""Start-up checks of a ``--speculative-config`` against the drafter and target configs.

Everything here runs when vLLM builds our proposer, before any weight is loaded, so a wrong
drafter fails the engine start with one message that names the field and the fix.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

from vllm.config import VllmConfig

from vllm_dflash.config import DrafterConfig, TargetConfig, check_compatible
from vllm_dflash.errors import DFlashConfigError


@lru_cache(maxsize=8)
def _load(model: str, revision: str | None) -> DrafterConfig:
    local = Path(model) / "config.json"
    if local.is_file():
        return DrafterConfig.from_file(local)
    # A hub id: vLLM has already fetched the config into the local hub cache.
    from huggingface_hub import hf_hub_download

    try:
        path = hf_hub_download(model, "config.json", revision=revision)
    except Exception as e:  # noqa: BLE001 - any hub failure means the same to the user
        raise DFlashConfigError(
            f"cannot read the drafter's config.json from {model!r}: {e}. Fix: point "
            "--speculative-config 'model' at a DFlash drafter directory or hub id"
        ) from None
    return DrafterConfig.from_file(path)


def drafter_config_of(vllm_config: VllmConfig) -> DrafterConfig:
    spec = vllm_config.speculative_config
    assert spec is not None and spec.draft_model_config is not None
    dm = spec.draft_model_config
    return _load(str(dm.model), dm.revision)


def target_config_of(vllm_config: VllmConfig) -> TargetConfig:
    hf: Any = vllm_config.model_config.hf_config
    return TargetConfig.from_dict(hf.to_dict(), source=f"target {vllm_config.model_config.model}")


def check_serving_config(vllm_config: VllmConfig) -> DrafterConfig:
    """Validate drafter, target and speculative config together; return the drafter config."""
    draft = drafter_config_of(vllm_config)
    check_compatible(draft, target_config_of(vllm_config))
    spec = vllm_config.speculative_config
    assert spec is not None
    k = spec.num_speculative_tokens
    if k is None or not 1 <= k <= draft.num_speculative_tokens:
        raise DFlashConfigError(
            f"field 'num_speculative_tokens' = {k}, but this drafter's block_size is "
            f"{draft.block_size}, so a block holds at most {draft.num_speculative_tokens} "
            f"draft tokens. Fix: set num_speculative_tokens between 1 and "
            f"{draft.num_speculative_tokens}"
        )
    if vllm_config.parallel_config.pipeline_parallel_size > 1:
        raise DFlashConfigError(
            "field 'pipeline_parallel_size' = "
            f"{vllm_config.parallel_config.pipeline_parallel_size}: the vllm-dflash proposer "
            "needs the target's hidden states on one pipeline stage. Fix: use "
            "tensor parallelism only, or VLLM_DFLASH_BACKEND=builtin"
        )
    return draft


def feature_layers(draft: DrafterConfig) -> tuple[int, ...]:
    """vLLM's auxiliary-hidden-state indices for the drafter's ``target_layer_ids``.

    vLLM records the residual stream entering layer i, i.e. the output of layer i-1, so a
    DFlash id (output of layer i, HF's ``hidden_states[i + 1]``) is vLLM index i + 1.
    """
    return tuple(i + 1 for i in draft.target_layer_ids)
