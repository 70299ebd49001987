"""Sampled drafts, each request's from its own random stream.

A request with a ``seed`` has its own ``torch.Generator`` in vLLM's sampling metadata, and
vLLM's sampler and rejection sampler draw that request's random numbers from it. Its drafts
are drawn from it too (vLLM's own draft sampler uses the global stream), so the drafts, and
with them the tokens, of a seeded request do not depend on the other requests in the batch:
the same seeded request gives the same tokens in any batch (with the draft policy's rule for
seeded requests, ``adaptive/policy.py``). Requests without a seed use the global stream.

Exponential-race sampling (argmax of p / E, E ~ Exp(1)) draws from p exactly, as vLLM's does.
"""

from __future__ import annotations

import torch

_GREEDY_EPS = 1e-5  # vLLM's threshold: a temperature below it is greedy


def sample(
    logits: torch.Tensor,  # [n, k, vocab] drafter logits of the drafting requests
    sampling_metadata: object,
    rows: list[int],  # [n] each request's row in the batch (its generator's key)
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (draft tokens [n, k], their distributions q [n, k, vocab] in float32)."""
    temperature = sampling_metadata.temperature  # [batch] on the device
    index = torch.tensor(rows, dtype=torch.int64).to(logits.device, non_blocking=True)
    t = temperature.index_select(0, index).float()  # [n]
    greedy = t < _GREEDY_EPS
    t = torch.where(greedy, torch.ones_like(t), t)
    probs = (logits.float() / t[:, None, None]).softmax(dim=-1)  # [n, k, vocab]
    noise = torch.empty_like(probs).exponential_()
    generators = sampling_metadata.generators
    for i, row in enumerate(rows):
        g = generators.get(row)
        if g is not None:
            noise[i].exponential_(generator=g)
    tokens = (probs / noise).argmax(dim=-1)
    tokens = torch.where(greedy[:, None], probs.argmax(dim=-1), tokens)
    return tokens, probs
