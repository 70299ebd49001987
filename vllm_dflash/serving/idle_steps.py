"""Runner V1 steps in which speculation does nothing: no request verifies drafts, or none
drafts. With the draft policy (``draft_plan.py``) those are most steps where drafts do not
pay, and vLLM still runs its speculative machinery in them. Two wraps of the model runner
(seam ``v1.runner``) give those steps the cost of plain decoding where it is ours to give:

* ``plain_sampling``: vLLM builds spec-decode metadata for every step once a speculative
  config exists, and so runs its rejection sampler even when no request has a draft. With
  no drafts, that sampler samples the bonus tokens with the plain sampler, on the same
  logits and the same random streams (it draws nothing for a request without drafts), and
  builds the rest around them; the plain sampler alone gives the same tokens. Requests
  that want logprobs keep vLLM's path (their logprobs are computed differently there), as
  does async scheduling.
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


def plain_sampling(sample):
    def sample_plain_without_drafts(self, logits, spec_decode_metadata):
        sampling_metadata = self.input_batch.sampling_metadata
        if (
            spec_decode_metadata is not None
            and not any(spec_decode_metadata.num_draft_tokens)
            and sampling_metadata.max_num_logprobs is None
            and not self.use_async_scheduling
        ):
            return self.sampler(logits=logits, sampling_metadata=sampling_metadata)
        return sample(self, logits, spec_decode_metadata)

    return sample_plain_without_drafts


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
