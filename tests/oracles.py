"""Drafters with known behaviour and exact target distributions, for losslessness tests.

They implement the same ``BlockDrafter`` protocol as the real DFlash drafter, so the
generation loop under test is the production one; only the proposals differ.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
from transformers import PreTrainedModel

from vllm_dflash.reference.sampling import SamplingConfig, probs_from_logits

_BIG = 30.0  # logit margin that makes a chosen token the argmax by far


@torch.no_grad()
def next_token_probs(
    model: PreTrainedModel, prefixes: torch.Tensor, sampling: SamplingConfig
) -> torch.Tensor:
    """Sampling distribution of the next token after each row of ``prefixes`` [n, t] -> [n, V]."""
    logits = model(input_ids=prefixes).logits[:, -1]
    return probs_from_logits(logits, sampling).double()


@torch.no_grad()
def exact_joint(
    model: PreTrainedModel, prompt: Sequence[int], n: int, sampling: SamplingConfig
) -> torch.Tensor:
    """P(x_1..x_n | prompt) as a [V]*n tensor, by enumerating every prefix (tiny V only)."""
    vocab = model.config.vocab_size
    joint = torch.ones(())
    for k in range(n):
        prefixes = torch.tensor(
            [list(prompt) + list(p) for p in itertools.product(range(vocab), repeat=k)]
        )
        step = next_token_probs(model, prefixes, sampling).reshape(*([vocab] * k), vocab)
        joint = joint[..., None] * step
    return joint


def marginal(joint: torch.Tensor, k: int) -> torch.Tensor:
    """P(x_k) from a joint law over ``joint.dim()`` tokens."""
    others = tuple(d for d in range(joint.dim()) if d != k)
    # (sum over an empty dim tuple would reduce everything: a 1-token joint is its marginal)
    return joint.sum(dim=others) if others else joint


class GreedyOracleDrafter:
    """Drafts the target's own greedy continuation, corrupting each slot with probability
    ``1 - accuracy`` (seeded), so acceptance lengths cover 0..block_size-1."""

    def __init__(self, model: PreTrainedModel, block_size: int, accuracy: float, seed: int = 0):
        self.model, self.block_size, self.accuracy = model, block_size, accuracy
        self.feature_layers: list[int] = []  # works from tokens alone
        self.rng = torch.Generator().manual_seed(seed)

    def reset(self) -> None:
        pass

    @torch.no_grad()
    def draft_logits(self, new_features, anchor_token, anchor_position, verified_tokens):
        ids = torch.tensor([list(verified_tokens)])
        out = self.model.generate(
            ids,
            max_new_tokens=self.block_size - 1,
            min_new_tokens=self.block_size - 1,
            do_sample=False,
            pad_token_id=0,
        )
        chosen = out[0, ids.shape[1] :].clone()
        vocab = self.model.config.vocab_size
        for i in range(chosen.shape[0]):
            if torch.rand((), generator=self.rng) > self.accuracy:
                shift = 1 + torch.randint(vocab - 1, (), generator=self.rng)
                chosen[i] = (chosen[i] + shift) % vocab
        logits = torch.zeros(chosen.shape[0], vocab)
        logits[torch.arange(chosen.shape[0]), chosen] = _BIG
        return logits


class MarginalOracleDrafter:
    """The best possible non-autoregressive drafter: slot k gets the target's exact marginal
    P(x_k | verified), summed over the unseen tokens before it (tiny V only)."""

    def __init__(self, model: PreTrainedModel, block_size: int, sampling: SamplingConfig):
        self.model, self.block_size, self.sampling = model, block_size, sampling
        self.feature_layers: list[int] = []  # works from tokens alone
        self._memo: dict[tuple[int, ...], torch.Tensor] = {}  # tests revisit few prefixes

    def reset(self) -> None:
        pass

    def draft_logits(self, new_features, anchor_token, anchor_position, verified_tokens):
        key = tuple(verified_tokens)
        if key not in self._memo:
            self._memo[key] = self._marginal_logits(key)
        return self._memo[key]

    def _marginal_logits(self, verified_tokens: tuple[int, ...]) -> torch.Tensor:
        g = self.block_size - 1
        # Marginals from the joint over the g unseen tokens; V**g forwards in one batch.
        joint = exact_joint(self.model, verified_tokens, g, self.sampling)
        marginals = torch.stack([marginal(joint, k) for k in range(g)])
        # The loop re-applies temperature to these logits: pre-scale so q comes out exact.
        return self.sampling.temperature * marginals.clamp_min(1e-30).log()
