"""Our DFlash proposer: vLLM's model runner calls it once per step to draft a whole block.

Per step, for a batch of B requests and K draft tokens:

1. The target has just run; the model runner hands us, for every token it computed, the
   concatenated hidden states of the drafter's ``target_layer_ids`` (our hook, see
   ``load_model``). The rows of accepted tokens are fused and written as context K/V into
   the drafter's paged cache at the target's own slots (``cad.slot_mapping``), so nothing
   is recomputed later; rows of rejected drafts are dropped first.
2. The block for request b is ``[last verified token, mask * K]`` at positions
   ``p_b + 1 .. p_b + 1 + K`` where ``p_b`` is the request's last accepted position.
   Rejected positions are rolled back by excluding them from ``seq_lens``; their cache slots
   are overwritten by this very block before anything reads them.
3. One drafter forward (non-causal attention over context + block) gives logits at the K
   mask positions: argmax for greedy requests, or a sample from the drafter's distribution
   together with those probabilities when the request samples, so that vLLM's rejection
   sampler can use them (DESIGN.md section 2).

Under tensor parallelism every rank runs all of this on its shard of the drafter (sharded
exactly like the target); the captured hidden states are the full residual stream on every
rank, and a greedy step all-gathers one (max, id) pair per rank instead of the vocabulary
(docs/tensor-parallel.md).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch
from typing_extensions import override
from vllm.config import VllmConfig
from vllm.forward_context import set_forward_context
from vllm.model_executor.models.interfaces import supports_eagle3
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.sample.metadata import SamplingMetadata
from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

from vllm_dflash.errors import DFlashConfigError
from vllm_dflash.serving.drafter_config import check_serving_config, feature_layers

# Under vLLM's "vllm" logger so the lines appear in vLLM's own log output.
logger = logging.getLogger("vllm.plugins.vllm_dflash")


class DFlashProposer(SpecDecodeBaseProposer):
    def __init__(self, vllm_config: VllmConfig, device: torch.device, runner: Any = None):
        # Validate before vLLM's base class reads anything from the drafter config.
        self.draft = check_serving_config(vllm_config)
        self.aux_layers = feature_layers(self.draft)
        spec = vllm_config.speculative_config
        assert spec is not None and spec.draft_model_config is not None
        # vLLM's model runner picks the target layers to capture from this dict; make sure
        # it holds the ids we resolved (a missing key would give EAGLE-3's three layers).
        hf = spec.draft_model_config.hf_config
        hf.dflash_config = {
            **(getattr(hf, "dflash_config", None) or {}),
            "target_layer_ids": list(self.draft.target_layer_ids),
            "mask_token_id": self.draft.mask_token_id,
        }
        super().__init__(vllm_config, device, pass_hidden_states_to_model=False, runner=runner)
        tp = vllm_config.parallel_config.tensor_parallel_size
        if spec.draft_tensor_parallel_size == 1 and tp > 1:
            logger.warning(
                "vllm-dflash: draft_tensor_parallel_size=1 is not honoured: the drafter is "
                "sharded over the target's %d ranks, as vLLM's built-in dflash does too "
                "(docs/tensor-parallel.md). Leave the field out to silence this.",
                tp,
            )

        k = self.num_speculative_tokens
        self.max_query_tokens = self.max_batch_size * (k + 1)
        max_padded = max(
            self.max_query_tokens,
            vllm_config.compilation_config.max_cudagraph_capture_size or 0,
        )
        # Persistent query buffers (fixed addresses for CUDA-graph replay).
        self.input_ids = torch.zeros(max_padded, dtype=torch.int32, device=device)
        self.positions = torch.zeros(max_padded, dtype=torch.int64, device=device)
        self._slot_mapping_buffer = torch.zeros(max_padded, dtype=torch.int64, device=device)
        self._block_offsets = torch.arange(k + 1, dtype=torch.int64, device=device)
        self._row_index = torch.arange(self.max_num_tokens, dtype=torch.int64, device=device)
        self._request_index = torch.arange(self.max_batch_size + 1, dtype=torch.int32)
        # Sampled requests get drafts sampled from the drafter's distribution q plus q itself,
        # so that the rejection sampler accepts with min(1, p/q) (DESIGN.md section 2) instead
        # of treating an argmax draft as one-hot. vLLM only does this when asked
        # (draft_sample_method="probabilistic"); for DFlash's marginal drafts it is our default.
        self._enable_probabilistic_draft_probs = spec.rejection_sample_method == "standard"

    # ---- configuration hooks of the base class ----------------------------------------
    @override
    def _create_draft_vllm_config(self) -> VllmConfig:
        base = super()._create_draft_vllm_config()
        # Pick an attention backend that can run the block without a causal mask.
        return dataclasses.replace(
            base,
            attention_config=dataclasses.replace(base.attention_config, use_non_causal=True),
        )

    @override
    def _get_eagle3_use_aux_hidden_state_from_config(self) -> bool:
        return True  # DFlash always drafts from the captured target layers

    @override
    def load_model(self, target_model: torch.nn.Module) -> None:
        """Load the drafter and install the hidden-state hook on the target."""
        if not supports_eagle3(target_model):
            raise DFlashConfigError(
                f"target architecture {type(target_model).__name__} cannot return "
                "intermediate hidden states, which DFlash drafts from. Fix: serve a target "
                "whose vLLM model implements SupportsEagle3 (Qwen3, Llama, ...), or drop "
                "--speculative-config"
            )
        super().load_model(target_model)
        # The hook: the target's forward returns the residual stream at these layers for
        # every scheduled token, and the runner passes them (concatenated) to ``propose``.
        target_model.set_aux_hidden_state_layers(self.aux_layers)
        logger.info(
            "vllm-dflash: drafting from target layers %s (%d draft tokens per step)",
            list(self.draft.target_layer_ids),
            self.num_speculative_tokens,
        )

    # ---- one decoding step -------------------------------------------------------------
    @override
    def propose(
        self,
        num_speculative_tokens: int,
        target_token_ids: torch.Tensor,
        target_positions: torch.Tensor,
        target_hidden_states: torch.Tensor,
        next_token_ids: torch.Tensor,
        token_indices_to_sample: torch.Tensor | None,
        common_attn_metadata: CommonAttentionMetadata,
        sampling_metadata: SamplingMetadata,
        mm_embed_inputs: Any = None,
        num_rejected_tokens_gpu: torch.Tensor | None = None,
        slot_mappings: Any = None,
    ) -> torch.Tensor:
        cad = common_attn_metadata
        k = num_speculative_tokens
        q = k + 1
        b = cad.num_reqs
        n_ctx = target_hidden_states.shape[0]
        self._last_draft_probs = None

        self._check_features(target_hidden_states, cad.num_actual_tokens)
        # 1. Context K/V for the positions the target just verified. Rows of rejected drafts
        # are left out before any work is done on them: with most drafts rejected they are
        # most of the rows (vLLM's built-in projects them all and lets them be overwritten).
        rows = self._verified_rows(cad, num_rejected_tokens_gpu, n_ctx)
        features, positions, slots = (
            target_hidden_states,
            target_positions[:n_ctx],
            cad.slot_mapping[:n_ctx],
        )
        if rows is not None:
            features, positions, slots = features[rows], positions[rows], slots[rows]
        self.model.write_context_kv(self.model.fuse(features), positions, slots)

        # 2. Block inputs: anchor = last verified token, then K masks.
        last = cad.query_start_loc[1 : b + 1].long() - 1
        seq_lens = cad.seq_lens[:b]
        if num_rejected_tokens_gpu is not None:
            last = last - num_rejected_tokens_gpu[:b]
            seq_lens = seq_lens - num_rejected_tokens_gpu[:b]
        pos = target_positions[last][:, None] + 1 + self._block_offsets[:q]  # [B, Q]
        n_q = b * q
        self.positions[:n_q] = pos.reshape(-1)
        ids = self.input_ids[:n_q].view(b, q)
        ids[:, 0] = next_token_ids[:b]
        ids[:, 1:] = self.draft.mask_token_id
        bs = self.block_size
        blocks = cad.block_table_tensor[:b].gather(1, pos // bs)
        slots = (blocks * bs + pos % bs).reshape(-1)

        query_start = self._request_index[: b + 1] * q  # k may be below the configured K
        block_cad = CommonAttentionMetadata(
            query_start_loc=query_start.to(cad.query_start_loc.device),
            query_start_loc_cpu=query_start,
            seq_lens=seq_lens + q,
            seq_lens_cpu_upper_bound=(
                None if cad.seq_lens_cpu_upper_bound is None else cad.seq_lens_cpu_upper_bound + q
            ),
            num_reqs=b,
            num_actual_tokens=n_q,
            max_query_len=q,
            max_seq_len=cad.max_seq_len + q,
            block_table_tensor=cad.block_table_tensor,
            slot_mapping=slots,
            causal=False,
        )
        _, per_layer = self.build_per_group_and_layer_attn_metadata(block_cad)
        mode, n_in, across_dp = self._determine_batch_execution_and_padding(n_q)

        # 3. One drafter forward over all blocks; logits only at the mask positions.
        with set_forward_context(
            per_layer,
            self.vllm_config,
            num_tokens=n_in,
            num_tokens_across_dp=across_dp,
            cudagraph_runtime_mode=mode,
            slot_mapping=self._get_slot_mapping(n_in, slots),
        ):
            hidden = self.model(self.input_ids[:n_in], self.positions[:n_in])
        masks = hidden[:n_q].view(b, q, -1)[:, 1:].reshape(b * k, -1)
        if sampling_metadata.all_greedy or not self._enable_probabilistic_draft_probs:
            return self.model.get_top_tokens(masks).view(b, k)
        # Sampled drafts need the whole distribution q for the rejection sampler.
        logits = self.model.compute_logits(masks)
        tokens, probs = self._sample_from_logits(logits, sampling_metadata)
        if probs is not None:
            self._last_draft_probs = probs.view(b, k, -1)
        return tokens.view(b, k)

    def _check_features(self, features: torch.Tensor, num_tokens: int) -> None:
        """Under tensor parallelism every rank must get the full residual stream of every
        target token (the layers' all-reduced output); a shard would draft silently worse."""
        expected = (num_tokens, self.draft.feature_size)
        if tuple(features.shape) != expected:
            raise DFlashConfigError(
                f"the target handed the drafter hidden states of shape "
                f"{list(features.shape)}, expected {list(expected)} ({num_tokens} tokens x "
                f"{len(self.aux_layers)} layers x hidden_size): this rank got a shard, not "
                "the full residual stream. Fix: turn off whatever option splits the target's "
                "hidden states across ranks, or serve with VLLM_DFLASH_BACKEND=builtin"
            )

    def _verified_rows(
        self, cad: CommonAttentionMetadata, num_rejected: torch.Tensor | None, n: int
    ) -> torch.Tensor | None:
        """Indices of the target rows that were accepted (None: all of them)."""
        if num_rejected is None:
            return None
        b = cad.num_reqs
        starts = cad.query_start_loc[: b + 1].long()
        request = torch.repeat_interleave(
            torch.arange(b, device=starts.device), starts.diff(), output_size=n
        )
        ends = starts[1:] - num_rejected[:b]
        # nonzero() synchronises with a GPU once per step; the rows it saves are worth more.
        return (self._row_index[:n] < ends[request]).nonzero().squeeze(1)

    @override
    @torch.inference_mode()
    def dummy_run(
        self,
        num_tokens: int,
        use_cudagraphs: bool = True,
        is_graph_capturing: bool = False,
        slot_mappings: dict[str, torch.Tensor] | None = None,
    ) -> None:
        """Memory profiling / warm-up: the context projection for ``num_tokens`` target
        tokens, then the block forward at its largest padded size."""
        n_q = min(num_tokens, self.max_query_tokens)
        mode, n_in, across_dp = self._determine_batch_execution_and_padding(
            n_q, use_cudagraphs=use_cudagraphs
        )
        features = torch.zeros(
            num_tokens, self.draft.feature_size, dtype=self.dtype, device=self.device
        )
        self.model.write_context_kv(
            self.model.fuse(features), self.positions.new_zeros(num_tokens), None
        )
        if slot_mappings and self._draft_attn_layer_names & slot_mappings.keys():
            slot_mapping = self._get_slot_mapping(n_in)
        else:
            slot_mapping = slot_mappings or {}
        with set_forward_context(
            None,
            self.vllm_config,
            num_tokens=n_in,
            num_tokens_across_dp=across_dp,
            cudagraph_runtime_mode=mode,
            slot_mapping=slot_mapping,
        ):
            self.model(self.input_ids[:n_in], self.positions[:n_in])
