"""Start-up checks of a ``--speculative-config`` against the drafter and target configs.

They run twice: in the process that parses the engine arguments (before vLLM's own
speculative-config processing, whose errors for a wrong drafter are less specific), and
again when the engine builds our proposer from the resolved config. A wrong drafter fails the
start with one message that names the field and the fix.
"""

from __future__ import annotations

from dataclasses import dataclass
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


def target_config_of(hf_config: Any, name: str) -> TargetConfig:
    # Attribute access, not to_dict(): HF configs map e.g. GPT-2's n_embd to hidden_size.
    hf = hf_config.get_text_config()
    fields = {field: getattr(hf, field, None) for field in TargetConfig.model_fields}
    fields["model_type"] = getattr(hf, "model_type", None) or "unknown"
    return TargetConfig.from_dict(fields, source=f"target {name}")


@dataclass(frozen=True)
class Parallelism:
    """The parallel layout the drafter is served with (vLLM's names; None = not given)."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    draft_tensor_parallel_size: int | None = None
    decode_context_parallel_size: int = 1
    prefill_context_parallel_size: int = 1

    @classmethod
    def of(cls, parallel_config: Any, draft_tensor_parallel_size: int | None) -> Parallelism:
        """From vLLM's ``ParallelConfig`` of the target."""
        return cls(
            parallel_config.tensor_parallel_size,
            parallel_config.pipeline_parallel_size,
            draft_tensor_parallel_size,
            parallel_config.decode_context_parallel_size,
            parallel_config.prefill_context_parallel_size,
        )


def check_speculative_config(
    draft_model: str,
    revision: str | None,
    target_hf_config: Any,
    target_name: str,
    num_speculative_tokens: int | None,
    parallel: Parallelism = Parallelism(),
) -> DrafterConfig:
    """Validate drafter, target and speculative config together; return the drafter config.

    ``num_speculative_tokens=None`` (not given yet) skips that one check."""
    draft = _load(str(draft_model), revision)
    check_compatible(draft, target_config_of(target_hf_config, target_name))
    k = num_speculative_tokens
    if k is not None and not 1 <= k <= draft.num_speculative_tokens:
        raise DFlashConfigError(
            f"field 'num_speculative_tokens' = {k}, but this drafter's block_size is "
            f"{draft.block_size}, so a block holds at most {draft.num_speculative_tokens} "
            f"draft tokens. Fix: set num_speculative_tokens between 1 and "
            f"{draft.num_speculative_tokens}"
        )
    check_parallel(draft, parallel)
    return draft


def check_parallel(draft: DrafterConfig, parallel: Parallelism) -> None:
    """The layouts our proposer serves: tensor parallelism with the drafter sharded exactly
    like the target (docs/tensor-parallel.md); no pipeline or context parallelism."""
    tp, pp = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
    if pp > 1:
        raise DFlashConfigError(
            f"field 'pipeline_parallel_size' = {pp}: the vllm-dflash proposer needs the "
            "target's hidden states from layers across the whole depth on one pipeline "
            "stage. Fix: use tensor parallelism only, or VLLM_DFLASH_BACKEND=builtin"
        )
    for name in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        if getattr(parallel, name) > 1:
            raise DFlashConfigError(
                f"field '{name}' = {getattr(parallel, name)}: the vllm-dflash proposer "
                "addresses the drafter's K/V through the target's block table as one "
                "unsplit cache per rank. Fix: serve without context parallelism, or "
                "VLLM_DFLASH_BACKEND=builtin"
            )
    draft_tp = parallel.draft_tensor_parallel_size
    # 1 is accepted (vLLM accepts it too) but the drafter is sharded all the same, as the
    # built-in's is: the proposer logs a warning saying so.
    if draft_tp is not None and draft_tp not in (1, tp):
        raise DFlashConfigError(
            f"field 'draft_tensor_parallel_size' = {draft_tp} with tensor_parallel_size = "
            f"{tp}: vllm-dflash shards the drafter like the target, so that its K/V shares "
            "the target's paged-cache layout and block table. Fix: leave "
            f"draft_tensor_parallel_size out or set it to {tp}"
        )
    kv = draft.num_key_value_heads
    unsplittable = [
        f"field '{name}' = {value}"
        for name, value, ok in (
            ("num_attention_heads", draft.num_attention_heads, draft.num_attention_heads % tp == 0),
            # vLLM replicates key/value heads when there are fewer of them than ranks.
            ("num_key_value_heads", kv, (kv % tp if kv >= tp else tp % kv) == 0),
            ("intermediate_size", draft.intermediate_size, draft.intermediate_size % tp == 0),
        )
        if not ok
    ]
    if unsplittable:
        raise DFlashConfigError(
            f"the drafter cannot be sharded over tensor_parallel_size = {tp}: "
            + ", ".join(unsplittable)
            + f" does not split into {tp} equal parts. Fix: serve with a "
            "tensor_parallel_size that divides num_attention_heads and intermediate_size "
            "and either divides num_key_value_heads or is a multiple of it"
        )


def check_serving_config(vllm_config: VllmConfig) -> DrafterConfig:
    """The same checks inside the engine, on the resolved config."""
    spec = vllm_config.speculative_config
    assert spec is not None and spec.draft_model_config is not None
    return check_speculative_config(
        str(spec.draft_model_config.model),
        spec.draft_model_config.revision,
        vllm_config.model_config.hf_config,
        str(vllm_config.model_config.model),
        spec.num_speculative_tokens,
        Parallelism.of(vllm_config.parallel_config, spec.draft_tensor_parallel_size),
    )


def feature_layers(draft: DrafterConfig) -> tuple[int, ...]:
    """vLLM's auxiliary-hidden-state indices for the drafter's ``target_layer_ids``.

    vLLM records the residual stream entering layer i, i.e. the output of layer i-1, so a
    DFlash id (output of layer i, HF's ``hidden_states[i + 1]``) is vLLM index i + 1.
    """
    return tuple(i + 1 for i in draft.target_layer_ids)
