"""Pydantic models for the z-lab DFlash drafter format and for the target it serves.

Every validation failure becomes a :class:`DFlashConfigError` whose message names the
field, the bad value and the fix, so a malformed ``config.json`` fails at start-up with
one readable paragraph instead of a stack trace from deep inside model construction.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, ClassVar, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from vllm_dflash.errors import DFlashConfigError

DFLASH_ARCHITECTURE = "DFlashDraftModel"

# How to fix each field when pydantic's own check (missing, wrong type, out of range) fails.
_FIELD_FIXES: dict[str, str] = {
    "architectures": f'set "architectures": ["{DFLASH_ARCHITECTURE}"]',
    "block_size": "set block_size to the block the drafter was trained with (e.g. 16 for *-b16)",
    "num_target_layers": "set num_target_layers to the target model's num_hidden_layers",
    "dflash_config": 'add "dflash_config": {"target_layer_ids": [...], "mask_token_id": N}',
    "dflash_config.mask_token_id": "set dflash_config.mask_token_id to the id of the <mask> token "
    "the drafter was trained with",
    "dflash_config.target_layer_ids": "list, in increasing order, the 0-based target layers "
    "whose hidden states the drafter fuses",
    "hidden_size": "copy hidden_size from the target model's config.json",
    "vocab_size": "copy vocab_size from the target model's config.json",
    "num_attention_heads": "set num_attention_heads to the drafter's attention head count",
    "num_key_value_heads": "set num_key_value_heads so that it divides num_attention_heads",
    "num_hidden_layers": "set num_hidden_layers to the number of drafter layers",
    "intermediate_size": "set intermediate_size to the drafter MLP width",
    "model_type": 'DFlash drafters are Qwen3-style: set "model_type": "qwen3"',
    "hidden_act": 'DFlash drafters use SiLU: set "hidden_act": "silu"',
}


def _describe(errors: ValidationError, source: str | None, model_name: str) -> str:
    lines = [f"{source + ': ' if source else ''}invalid {model_name}:"]
    for err in errors.errors():
        msg = err["msg"].removeprefix("Value error, ")
        if not err["loc"]:  # a cross-field check: its message names the fields itself
            lines.append(f"  - {msg}")
            continue
        field = ".".join(str(p) for p in err["loc"])
        value = "<missing>" if err["type"] == "missing" else repr(err.get("input"))
        fix = _FIELD_FIXES.get(field)
        line = f"  - field '{field}' = {value}: {msg}"
        if fix and "Fix:" not in msg:
            line += f". Fix: {fix}"
        lines.append(line)
    return "\n".join(lines)


def last_feature_layer(num_target_layers: int) -> int:
    """Highest usable feature layer. Layer i's feature is its output before the final norm;
    HF exposes the last layer's output only after that norm (``hidden_states[-1]``), so the
    reference engine could not reproduce it."""
    return num_target_layers - 2


def default_target_layer_ids(num_target_layers: int, num_selected: int) -> list[int]:
    """Uniformly pick ``num_selected`` target layers between the 2nd and the third-to-last.

    This is the rule the public DFlash checkpoints were trained with (start=1,
    end=L-3, ids = round(start + i*(end-start)/(n-1))); a single layer takes the middle.
    """
    if num_selected < 1:
        raise DFlashConfigError(f"num_selected must be >= 1, got {num_selected}")
    if num_selected == 1:
        ids = [num_target_layers // 2]
    else:
        start, end = 1, num_target_layers - 3
        span = end - start
        ids = [int(round(start + i * span / (num_selected - 1))) for i in range(num_selected)]
    if len(set(ids)) != len(ids) or max(ids) > last_feature_layer(num_target_layers):
        raise DFlashConfigError(
            f"a {num_target_layers}-layer target is too shallow to pick {num_selected} distinct "
            "feature layers by the default rule. Fix: set dflash_config.target_layer_ids"
        )
    return ids


class DFlashSection(BaseModel):
    """The ``dflash_config`` block of a z-lab drafter config."""

    model_config = ConfigDict(extra="allow")

    mask_token_id: int = Field(ge=0)
    target_layer_ids: list[int] | None = None

    @field_validator("target_layer_ids")
    @classmethod
    def _ids_valid(cls, ids: list[int] | None) -> list[int] | None:
        if ids is None:
            return ids
        if not ids:
            raise ValueError("must not be empty. Fix: list at least one target layer")
        if any(i < 0 for i in ids):
            raise ValueError("contains a negative layer id. Fix: use 0-based layer indices")
        # vLLM gathers the layers in layer order; any other order would permute fc's input.
        if any(a >= b for a, b in zip(ids, ids[1:], strict=False)):
            raise ValueError(
                "must be strictly increasing (no duplicates). Fix: list each layer once, "
                "in the order the drafter was trained with, which is layer order"
            )
        return ids


class JsonConfig(BaseModel):
    """A config parsed from JSON whose validation errors become one DFlashConfigError."""

    kind: ClassVar[str] = "config"

    @classmethod
    def _prepare(cls, data: dict[str, Any]) -> dict[str, Any]:
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str | None = None) -> Self:
        try:
            return cls.model_validate(cls._prepare(data))
        except ValidationError as e:
            raise DFlashConfigError(_describe(e, source, cls.kind)) from None

    @classmethod
    def from_file(cls, path: str | Path) -> Self:
        return cls.from_dict(read_json(path), source=str(path))


class DrafterConfig(JsonConfig):
    """A DFlash drafter's ``config.json`` (Qwen3 fields + DFlash fields).

    Unknown keys are kept (HF configs carry many we do not need) but the fields the
    drafter's math depends on are validated here.
    """

    model_config = ConfigDict(extra="allow")
    kind: ClassVar[str] = "DFlash drafter config"

    architectures: list[str]
    # The drafter's layers are Qwen3-style whatever the target; exporters for Llama targets
    # may label the config "llama" (same fields). Key validation catches a real mismatch.
    model_type: Literal["qwen3", "llama"] = "qwen3"
    hidden_size: int = Field(gt=0)
    intermediate_size: int = Field(gt=0)
    num_hidden_layers: int = Field(gt=0)
    num_attention_heads: int = Field(gt=0)
    num_key_value_heads: int = Field(gt=0)
    head_dim: int | None = Field(default=None, gt=0)
    vocab_size: int = Field(gt=0)
    rms_norm_eps: float = Field(default=1e-6, gt=0)
    rope_theta: float | None = Field(default=None, gt=0)
    rope_scaling: dict[str, Any] | None = None
    rope_parameters: dict[str, Any] | None = None
    max_position_embeddings: int = Field(default=40960, gt=0)
    attention_bias: bool = False
    hidden_act: Literal["silu"] = "silu"
    block_size: int = Field(ge=2, le=64)
    num_target_layers: int = Field(gt=0)
    target_hidden_size: int | None = Field(default=None, gt=0)
    dflash_config: DFlashSection

    @field_validator("architectures")
    @classmethod
    def _is_dflash(cls, archs: list[str]) -> list[str]:
        if DFLASH_ARCHITECTURE not in archs:
            raise ValueError(
                f"does not contain '{DFLASH_ARCHITECTURE}'. Fix: point --speculative-config "
                f"'model' at a DFlash drafter checkpoint, or set \"architectures\": "
                f'["{DFLASH_ARCHITECTURE}"]'
            )
        return archs

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        self._full_bidirectional_attention_only()
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}. Fix: use a divisor"
            )
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size={self.hidden_size} is not divisible by num_attention_heads="
                f"{self.num_attention_heads} and head_dim is absent. Fix: set head_dim"
            )
        if self.resolved_head_dim % 2:
            raise ValueError(f"head_dim={self.resolved_head_dim} must be even for RoPE")
        for rope in (self.rope_parameters or {}, self.rope_scaling or {}):
            rope_type = rope.get("rope_type", rope.get("type", "default"))  # "type": older HF
            if rope_type != "default":
                raise ValueError(
                    f"rope_type={rope_type!r} is not supported by DFlash drafters yet. "
                    "Fix: use plain RoPE (rope_scaling: null)"
                )
        ids = self.dflash_config.target_layer_ids
        if ids is not None and max(ids) > last_feature_layer(self.num_target_layers):
            raise ValueError(
                f"dflash_config.target_layer_ids={ids} has layer {max(ids)} but "
                f"num_target_layers={self.num_target_layers}. Fix: use ids in "
                f"[0, {last_feature_layer(self.num_target_layers)}]"
            )
        if self.dflash_config.mask_token_id >= self.vocab_size:
            raise ValueError(
                f"dflash_config.mask_token_id={self.dflash_config.mask_token_id} is outside "
                f"the vocabulary (vocab_size={self.vocab_size}). Fix: use the drafter's "
                "<mask> token id, which must be < vocab_size"
            )
        return self

    def _full_bidirectional_attention_only(self) -> None:
        """vLLM honours keys that make drafter layers causal or sliding-window; the DFlash
        drafter here is full bidirectional attention only, so refuse rather than ignore them."""
        extra, section = self.model_extra or {}, self.dflash_config.model_extra or {}
        found = {
            "is_causal": extra.get("is_causal"),
            "dflash_config.causal": section.get("causal"),
            "dflash_config.use_swa": section.get("use_swa"),
            "use_sliding_window": extra.get("use_sliding_window"),
        }
        bad = {k: v for k, v in found.items() if v}
        layer_types = extra.get("layer_types") or []
        if any(t != "full_attention" for t in layer_types):
            bad["layer_types"] = layer_types
        if bad:
            field, value = next(iter(bad.items()))
            raise ValueError(
                f"{field}={value!r} asks for causal or sliding-window drafter attention, which "
                "vllm-dflash does not support yet. Fix: use a standard DFlash drafter "
                "(bidirectional, full attention) or remove the key"
            )

    # ---- derived values -------------------------------------------------------------
    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def resolved_rope_theta(self) -> float:
        if self.rope_parameters and "rope_theta" in self.rope_parameters:
            return float(self.rope_parameters["rope_theta"])
        return float(self.rope_theta or 10_000.0)  # HF's default for Qwen3 and Llama

    @property
    def target_layer_ids(self) -> list[int]:
        """Explicit ids, else the uniform rule with one layer per drafter layer (z-lab)."""
        ids = self.dflash_config.target_layer_ids
        if ids is not None:
            return list(ids)
        return default_target_layer_ids(self.num_target_layers, self.num_hidden_layers)

    @property
    def feature_size(self) -> int:
        """Width of one position's concatenated target features (the input of ``fc``)."""
        return len(self.target_layer_ids) * (self.target_hidden_size or self.hidden_size)

    @property
    def mask_token_id(self) -> int:
        return self.dflash_config.mask_token_id

    @property
    def num_speculative_tokens(self) -> int:
        """Draft tokens per block: the anchor occupies one of the block's slots."""
        return self.block_size - 1

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json", exclude_none=True)


class TargetConfig(JsonConfig):
    """The few fields of a target model's HF config that a drafter must agree with."""

    model_config = ConfigDict(extra="allow")
    kind: ClassVar[str] = "target model config"

    model_type: str = "unknown"
    hidden_size: int = Field(gt=0)
    vocab_size: int = Field(gt=0)
    num_hidden_layers: int = Field(gt=0)

    @classmethod
    def _prepare(cls, data: dict[str, Any]) -> dict[str, Any]:
        # Multimodal wrappers (e.g. Qwen3.5) nest the language model under text_config.
        if "text_config" in data and "hidden_size" not in data:
            return {**data["text_config"], "model_type": data.get("model_type", "unknown")}
        return data


class DFlashSpeculativeConfig(JsonConfig):
    """The JSON of ``vllm serve --speculative-config`` for DFlash, as a deployment writes it.

    Only the fields DFlash gives meaning to are typed here; vLLM's own ``SpeculativeConfig``
    refuses any other unknown key when the engine starts, so a manifest test checks the
    remaining names against it too (tests/test_deploy_k8s.py)."""

    model_config = ConfigDict(extra="allow")
    kind: ClassVar[str] = "--speculative-config"

    method: Literal["dflash"]
    model: str = Field(min_length=1)
    num_speculative_tokens: int | None = Field(default=None, ge=1)
    revision: str | None = None
    draft_tensor_parallel_size: int | None = Field(default=None, ge=1)


_FIELD_FIXES |= {
    "method": 'set "method": "dflash"',
    "model": 'set "model" to the drafter (hub id or directory), e.g. z-lab/Qwen3-8B-DFlash-b16',
    "num_speculative_tokens": "set num_speculative_tokens between 1 and block_size - 1 "
    "(15 for a b16 drafter)",
    "draft_tensor_parallel_size": "leave it out (the drafter is sharded like the target) "
    "or set it to tensor_parallel_size",
}


def check_compatible(draft: DrafterConfig, target: TargetConfig) -> None:
    """Raise one error listing every way ``draft`` cannot serve ``target``."""
    problems: list[str] = []
    if draft.hidden_size != target.hidden_size:
        problems.append(
            f"field 'hidden_size' = {draft.hidden_size} but the target's hidden_size is "
            f"{target.hidden_size}; the drafter shares the target's embedding and LM head. "
            "Fix: use a drafter trained for this target"
        )
    feat = draft.target_hidden_size
    if feat is not None and feat != target.hidden_size:
        problems.append(
            f"field 'target_hidden_size' = {feat} but the target's hidden_size is "
            f"{target.hidden_size}. Fix: use a drafter trained for this target"
        )
    if draft.vocab_size != target.vocab_size:
        problems.append(
            f"field 'vocab_size' = {draft.vocab_size} but the target's vocab_size is "
            f"{target.vocab_size}. Fix: use a drafter trained for this target's tokenizer"
        )
    if draft.mask_token_id >= target.vocab_size:
        problems.append(
            f"field 'dflash_config.mask_token_id' = {draft.mask_token_id} is outside the "
            f"target vocabulary (vocab_size={target.vocab_size}). Fix: use a mask id < "
            f"{target.vocab_size}"
        )
    if draft.num_target_layers != target.num_hidden_layers:
        problems.append(
            f"field 'num_target_layers' = {draft.num_target_layers} but the target has "
            f"{target.num_hidden_layers} layers. Fix: use a drafter trained for this target"
        )
    last = last_feature_layer(target.num_hidden_layers)
    bad = [i for i in draft.target_layer_ids if not 0 <= i <= last]
    if bad:
        problems.append(
            f"field 'dflash_config.target_layer_ids' = {draft.target_layer_ids}: "
            f"{bad} out of range for a target with {target.num_hidden_layers} layers. "
            f"Fix: use ids in [0, {last}]"
        )
    if problems:
        raise DFlashConfigError(
            "drafter is not compatible with the target model:\n  - " + "\n  - ".join(problems)
        )


def read_json(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise DFlashConfigError(f"{path}: file not found. Fix: check the model directory path")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise DFlashConfigError(
            f"{path}: not valid JSON (line {e.lineno}, column {e.colno}: {e.msg}). "
            "Fix: repair or re-download the file"
        ) from None
    if not isinstance(data, dict):
        raise DFlashConfigError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data
