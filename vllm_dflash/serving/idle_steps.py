"""Runner V1 steps in which speculation does nothing: no request verifies drafts, or none
drafts. With the draft policy (``draft_plan.py``) those are most steps where drafts do not
pay, and vLLM still runs its speculative machinery in them. Two wraps of the model runner
(seam ``v1.runner``) give those steps the cost of plain decoding where it is ours to give:

* ``plain_inputs``: vLLM 0.32 / 0.33 build spec-decode metadata for every step once a
  speculative config exists (``_prepare_inputs``: per-request draft counts, logits and
  draft-token indices, host-to-device copies), and so run the rejection sampler even when
  no request has a draft. Where no request verifies a draft, the step's inputs are built
  as a plain engine builds them (no metadata), and vLLM's runner then samples with the
  plain sampler and drafts from every scheduled token (its branch for a step without
  metadata): the same tokens (with no drafts the rejection sampler samples the bonus
  tokens with that sampler, on the same logits and random streams), for less. vLLM's
  path is kept for requests that want logprobs (computed differently there), async
  scheduling, and hybrid (Mamba-style) targets, whose attention metadata reads the
  speculative draft counts.
* ``sparing_drafting``: where nothing was verified and nobody drafts, vLLM's preparation of
  the drafter's inputs (next tokens, rejected-row bookkeeping, attention metadata) serves
  nothing; the proposer gets the captured features directly for its context K/V write,
  and the scheduler gets empty draft lists instead of a [batch, K] tensor of zeros to copy,
  convert and cut. (The policy is not served under async scheduling, the one mode whose
  input preparation reads the previous step's drafts as a tensor.)
"""

from __future__ import annotations

import torch

from vllm_dflash.serving import draft_plan


def plain_inputs(prepare_inputs):
    # The seam's behaviour check (seams.BEHAVIOURS["v1.prepare_inputs_reads_spec_once"])
    # makes sure _prepare_inputs reads speculative_config once, to choose this branch.
    def prepare_inputs_plain_without_drafts(self, scheduler_output, *args, **kwargs):
        spec = self.speculative_config
        if (
            spec is None
            or any(scheduler_output.scheduled_spec_decode_tokens.values())
            or self.use_async_scheduling
            or self.model_config.is_hybrid
            or self.input_batch.sampling_metadata.max_num_logprobs is not None
        ):
            return prepare_inputs(self, scheduler_output, *args, **kwargs)
        self.speculative_config = None  # the plain engine's branch, for this call only
        try:
            return prepare_inputs(self, scheduler_output, *args, **kwargs)
        finally:
            self.speculative_config = spec

    return prepare_inputs_plain_without_drafts


def sparing_drafting(propose_draft_token_ids):
    import inspect

    from vllm_dflash.serving.drafter_faults import no_drafts
    from vllm_dflash.serving.proposer import DFlashProposer

    # vLLM passes the arguments by position, in the order the seam checks; reading them by
    # index is what an idle step can afford (``inspect.Signature.bind`` costs more than the
    # rest of its glue), with the bind kept for a caller that passes names.
    signature = inspect.signature(propose_draft_token_ids)
    names = list(signature.parameters)[1:]  # after self
    aux_at, cad_at = names.index("aux_hidden_states"), names.index("common_attn_metadata")

    def propose_draft_token_ids_sparing(self, *args, **kwargs):
        if len(args) > cad_at:
            so, aux, cad = args[0], args[aux_at], args[cad_at]
        else:
            a = signature.bind(self, *args, **kwargs).arguments
            so, aux, cad = (
                a["scheduler_output"],
                a["aux_hidden_states"],
                a["common_attn_metadata"],
            )
        drafter = self.drafter
        if (
            aux is not None
            and not any(so.scheduled_spec_decode_tokens.values())
            and draft_plan.nobody_drafts()
            and isinstance(drafter, DFlashProposer)
        ):
            n = so.total_num_scheduled_tokens
            drafter.context_only(
                torch.cat([h[:n] for h in aux], dim=-1), self._get_positions(n), cad
            )
            return no_drafts(self)  # empty lists: nothing to copy, nothing to verify
        return propose_draft_token_ids(self, *args, **kwargs)

    return propose_draft_token_ids_sparing
