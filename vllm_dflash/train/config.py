"""``vllm-dflash train`` settings: one pydantic model, from a JSON/TOML file and/or flags.

Unknown keys are errors (a typo must not silently train with a default). Every field is
also a flag: ``--block-size 16`` overrides ``block_size`` from ``--config``.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any, ClassVar, Literal, Self

from pydantic import ConfigDict, Field, model_validator

from vllm_dflash.config import JsonConfig, read_json
from vllm_dflash.errors import DFlashConfigError


class TrainConfig(JsonConfig):
    kind: ClassVar[str] = "training config"
    model_config = ConfigDict(extra="forbid")

    # what to train on
    target: Path = Field(description="target model directory (HF format, frozen)")
    data: Path = Field(
        description="samples JSONL written by `vllm-dflash gen-data`, or its shard directory"
    )
    out: Path = Field(description="output directory: drafter, checkpoint, log, plot")
    features: Path | None = Field(
        None, description="features directory from `vllm-dflash capture`; unset = online"
    )
    eval_prompts: Path | None = Field(
        None, description="held-out prompts JSONL for periodic acceptance-length eval"
    )
    strict: bool = Field(False, description="refuse data files with bad lines")

    # the drafter
    init_from: Path | None = Field(
        None, description="start from this drafter checkpoint (its config wins)"
    )
    block_size: int = Field(16, ge=2, le=64)
    train_block_sizes: list[int] | None = Field(
        None,
        description="block lengths to train, one drawn per block, each <= block_size "
        "(serving with num_speculative_tokens K drafts a block of K+1); unset = block_size",
    )
    num_layers: int = Field(5, ge=1, description="drafter layers (paper: 5)")
    num_feature_layers: int = Field(5, ge=1, description="target layers fused (paper: 5)")
    target_layer_ids: list[int] | None = Field(
        None, description="explicit target layers; unset = the default uniform rule"
    )
    intermediate_size: int | None = Field(None, ge=1, description="unset = the target's")
    mask_token_id: int | None = Field(
        None, description="unset = the tokenizer's mask token, else its last id"
    )

    # the recipe
    anchors: Literal["random", "grid"] = "random"
    blocks_per_seq: int = Field(16, ge=1, description="anchors (blocks) per sequence")
    loss_decay: bool = True
    decay_gamma: float | None = Field(
        None, gt=0, description="loss-decay constant gamma_d; unset = paper default"
    )
    attention: Literal["auto", "flex", "dense"] = "auto"

    # optimisation
    steps: int = Field(1000, ge=1, description="optimizer steps")
    batch_size: int = Field(
        8, ge=1, description="sequences per micro-batch, over all ranks together"
    )
    grad_accum: int = Field(1, ge=1)
    lr: float = Field(6e-4, gt=0)
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    warmup_steps: int = Field(50, ge=0)
    weight_decay: float = Field(0.0, ge=0)
    grad_clip: float = Field(1.0, gt=0)
    dtype: Literal["fp32", "bf16"] = "fp32"
    max_seq_len: int = Field(1024, ge=8)
    seed: int = 0
    parallel: Literal["ddp", "fsdp"] = Field(
        "ddp",
        description="under torchrun: ddp (a replica per rank) or fsdp (weights, gradients "
        "and optimizer state sharded over ranks)",
    )

    # bookkeeping
    eval_every: int = Field(200, ge=0, description="steps between evals; 0 = only at the end")
    eval_num_prompts: int = Field(16, ge=1)
    eval_max_tokens: int = Field(64, ge=1)
    save_every: int = Field(200, ge=0, description="steps between checkpoints; 0 = end only")
    resume: bool = Field(False, description="continue from out/checkpoint")
    stop_after: int | None = Field(
        None, ge=1, description="stop after this step with a checkpoint; --resume continues"
    )
    export_dtype: Literal["float32", "bfloat16"] = "float32"

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        if self.target_layer_ids is not None and len(self.target_layer_ids) < 1:
            raise ValueError("field 'target_layer_ids' is empty. Fix: list at least one layer")
        sizes = self.train_block_sizes
        if sizes is not None and (not sizes or min(sizes) < 2):
            raise ValueError(
                f"field 'train_block_sizes' = {sizes}: every block needs an anchor and at "
                "least one mask. Fix: list sizes >= 2, e.g. [8, 16]"
            )
        return self

    @classmethod
    def load(cls, path: str | Path | None, overrides: dict[str, Any]) -> Self:
        """``path`` (JSON or TOML) with ``overrides`` on top; unset overrides are ignored."""
        data: dict[str, Any] = {}
        if path is not None:
            p = Path(path)
            if p.suffix == ".toml":
                try:
                    data = tomllib.loads(p.read_text())
                except (OSError, tomllib.TOMLDecodeError) as e:
                    raise DFlashConfigError(f"{p}: cannot read TOML ({e})") from None
            else:
                data = read_json(p)
        data |= {k: v for k, v in overrides.items() if v is not None}
        return cls.from_dict(data, source=str(path) if path else "train flags")
