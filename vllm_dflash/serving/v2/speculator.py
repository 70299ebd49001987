"""Our DFlash speculator for vLLM's model runner V2, the runner GPU vLLM uses by default.

It is vLLM's own runner-V2 DFlash orchestration, subclassed (seam ``v2.speculator_base``),
driving our drafter (``drafter_model.py``) through the interface runner V2 defines for
DFlash drafters. vLLM keeps what is version-specific and device-bound: the per-step inputs
built on the device by its Triton kernel (block positions and slots, rejected rows' context
slots set to -1), the context write and the block forward captured in one full CUDA graph
per batch size, drafts sampled inside the graph. vLLM 0.32 / 0.33 reach this class through
the runner's ``init_speculator`` (``install.py``), 0.34 through the drafter class's
``speculator_config_class`` (``config.py``).

What it adds, each the same as in our V1 proposer (``proposer.py``):

* start-up checks of drafter, target and parallel layout (``start_checks.py``), and the
  target layers the runner captures pinned to the drafter's;
* our drafter enforced: a registry that resolves ``DFlashDraftModel`` to another class
  stops the start instead of serving something else under our name;
* the context-K/V path (fused op or PyTorch) decided before capture (``bind_kv_cache``),
  never inside a graph;
* every step, a host-side check that this rank got the full hidden states (tensor
  parallelism), and the drafter's time in the step (``step_timing.drafting``).

Drafts for sampled requests are drawn from the drafter's distribution q (temperature
applied, keyed by the request's seed) and the rejection sampler divides by the same q from
the cached draft logits, because our engine-argument hook defaults ``draft_sample_method``
to ``"probabilistic"`` (``activate.SPEC_DEFAULTS``).
"""

from __future__ import annotations

from typing import Any

import torch

from vllm_dflash.errors import DFlashConfigError
from vllm_dflash.serving import start_checks, step_timing
from vllm_dflash.serving.drafter_model import DFlashDraftModel
from vllm_dflash.serving.seams import resolve

_VllmDFlashSpeculator: Any = resolve("v2.speculator_base")


class DFlashSpeculator(_VllmDFlashSpeculator):
    def __init__(self, vllm_config: Any, device: torch.device) -> None:
        # Validate before vLLM's base class reads anything from the drafter config.
        self.draft = start_checks.checked_drafter(vllm_config)
        super().__init__(vllm_config, device)

    def load_draft_model(
        self, target_model: torch.nn.Module, target_attn_layer_names: set[str]
    ) -> torch.nn.Module:
        start_checks.check_target(target_model)
        model = super().load_draft_model(target_model, target_attn_layer_names)
        if not isinstance(model, DFlashDraftModel):
            raise DFlashConfigError(
                f"vLLM loaded {type(model).__module__}.{type(model).__name__} for the "
                "drafter's DFlashDraftModel architecture, not vllm-dflash's drafter: another "
                "plugin registered that architecture. Fix: uninstall the other plugin, or "
                "set VLLM_DFLASH_BACKEND=builtin"
            )
        return model

    def capture(self) -> None:
        # Probing the cache layout synchronises with the device: never inside a capture.
        self.model.bind_kv_cache()
        super().capture()

    def propose(
        self,
        input_batch: Any,
        attn_metadata: dict[str, Any],
        slot_mappings: dict[str, torch.Tensor],
        last_hidden_states: torch.Tensor,  # [num_tokens, hidden_size]
        aux_hidden_states: list[torch.Tensor] | None,  # layers x [num_tokens, hidden_size]
        *args: Any,
        **kwargs: Any,
    ) -> torch.Tensor:
        # What vLLM hands combine_hidden_states: the layers concatenated, or (no layers
        # captured) the last hidden state, which the check then refuses by its width.
        features = aux_hidden_states or [last_hidden_states]
        shape = (features[0].shape[0], sum(h.shape[-1] for h in features))
        start_checks.check_features(self.draft, shape, input_batch.num_tokens)
        with step_timing.drafting():
            return super().propose(
                input_batch,
                attn_metadata,
                slot_mappings,
                last_hidden_states,
                aux_hidden_states,
                *args,
                **kwargs,
            )
