"""A Hugging Face causal LM as a speculative-decoding target: KV cache, crop, fused features."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, DynamicCache, PreTrainedModel

from vllm_dflash.config import TargetConfig


class HFTarget:
    """Wraps any HF causal LM that returns ``hidden_states`` (``output_hidden_states=True``).

    Features are the concatenated outputs of the layers a drafter asks for; HF's
    ``hidden_states[0]`` is the embedding output, so layer i's output is ``hidden_states[i+1]``.
    """

    def __init__(self, model: PreTrainedModel):
        self.model = model.eval().requires_grad_(False)
        self.cache: DynamicCache | None = None

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype = torch.float32) -> HFTarget:
        return cls(AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype))

    @property
    def config(self) -> TargetConfig:
        return TargetConfig.from_dict(self.model.config.to_dict(), source="target model config")

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    @property
    def device(self) -> torch.device:
        return self.model.device

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.get_input_embeddings()(ids)

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.get_output_embeddings()(hidden)

    def reset(self) -> None:
        self.cache = DynamicCache(config=self.model.config)

    @property
    def cached_length(self) -> int:
        return 0 if self.cache is None else self.cache.get_seq_length()

    @torch.no_grad()
    def forward(
        self, ids: Sequence[int], feature_layers: Sequence[int] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run ``ids`` after the cached prefix; return logits [T, V] and, when
        ``feature_layers`` is given, features [T, len(feature_layers) * hidden]."""
        if self.cache is None:
            self.reset()
        start = self.cached_length
        input_ids = torch.tensor([list(ids)], dtype=torch.long, device=self.device)
        positions = torch.arange(start, start + input_ids.shape[1], device=self.device)[None]
        out = self.model(
            input_ids=input_ids,
            position_ids=positions,
            past_key_values=self.cache,
            use_cache=True,
            output_hidden_states=feature_layers is not None,
        )
        self.cache = out.past_key_values
        feats = None
        if feature_layers is not None:
            hidden = out.hidden_states  # a zero-width first piece keeps [T, 0] when no layers
            feats = torch.cat(
                [hidden[0][0, :, :0], *(hidden[i + 1][0] for i in feature_layers)], dim=-1
            )
        return out.logits[0], feats

    def crop(self, length: int) -> None:
        """Keep the first ``length`` cached positions (drop rejected draft rows)."""
        extra = self.cached_length - length
        if extra > 0:
            self.cache.crop(-extra)
