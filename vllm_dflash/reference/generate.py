"""Target-only and speculative generation for one sequence (the reference engine).

Both loops share stop/length handling, so any difference between their outputs comes
from drafting and verification alone.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

from vllm_dflash.reference.drafter import BlockDrafter
from vllm_dflash.reference.sampling import SamplingConfig, probs_from_logits, sample
from vllm_dflash.reference.target import HFTarget
from vllm_dflash.reference.verify import verify_greedy, verify_rejection

GREEDY = SamplingConfig()


@dataclass
class GenerationResult:
    tokens: list[int] = field(default_factory=list)
    stop_reason: Literal["stop", "length"] = "length"
    # Drafted tokens accepted at each verify step (empty for target-only generation).
    accepted: list[int] = field(default_factory=list)
    drafted: list[int] = field(default_factory=list)
    # Tokens the last step produced beyond a stop token or max_new_tokens (dropped).
    truncated: int = 0
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    total_s: float = 0.0

    @property
    def num_steps(self) -> int:
        return len(self.accepted)

    @property
    def acceptance_length(self) -> float:
        """tau: tokens committed per verify step (accepted drafts + the target's token).

        It measures the verifier's acceptance, so it also counts tokens the last step produced
        past a stop token or ``max_new_tokens`` (see ``truncated``)."""
        return sum(m + 1 for m in self.accepted) / max(1, self.num_steps)

    def per_position_acceptance(self) -> list[float]:
        """Cumulative acceptance c_k: the fraction of steps whose slots 1..k were all accepted
        (k = 1..longest draft), the convention of vLLM's per-position counters."""
        g = max(self.drafted, default=0)
        n = max(1, self.num_steps)
        return [sum(m >= k for m in self.accepted) / n for k in range(1, g + 1)]

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens after the first (which prefill produces) per second of decoding."""
        decode_s = self.total_s - self.prefill_s
        return (len(self.tokens) - 1) / decode_s if decode_s > 0 else float("nan")

    def push(self, token: int, max_new_tokens: int, stop_ids: Collection[int]) -> bool:
        """Append one token; return True when generation must end."""
        self.tokens.append(token)
        if token in stop_ids:
            self.stop_reason = "stop"
            return True
        if len(self.tokens) >= max_new_tokens:
            self.stop_reason = "length"
            return True
        return False


def _choose(logits: torch.Tensor, sampling: SamplingConfig, gen: torch.Generator | None) -> int:
    if sampling.greedy:
        return int(logits.argmax(-1))
    return int(sample(probs_from_logits(logits, sampling), gen))


def _check(prompt_ids: Sequence[int], max_new_tokens: int) -> None:
    if not prompt_ids:
        raise ValueError("prompt_ids is empty: a prompt needs at least one token")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens}: must be >= 1")


@torch.no_grad()
def target_generate(
    target: HFTarget,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    sampling: SamplingConfig = GREEDY,
    stop_token_ids: Collection[int] = (),
    generator: torch.Generator | None = None,
) -> GenerationResult:
    """Plain autoregressive decoding: one target forward per token."""
    _check(prompt_ids, max_new_tokens)
    res = GenerationResult()
    t0 = time.perf_counter()
    target.reset()
    logits, _ = target.forward(prompt_ids)
    res.prefill_s = time.perf_counter() - t0
    while not res.push(_choose(logits[-1], sampling, generator), max_new_tokens, stop_token_ids):
        logits, _ = target.forward([res.tokens[-1]])
    res.total_s = time.perf_counter() - t0
    return res


@torch.no_grad()
def spec_generate(
    target: HFTarget,
    drafter: BlockDrafter,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    sampling: SamplingConfig = GREEDY,
    stop_token_ids: Collection[int] = (),
    generator: torch.Generator | None = None,
) -> GenerationResult:
    """DFlash speculative decoding: one drafter forward + one target forward per step.

    Invariant at the top of each step: the target's KV cache and ``features`` cover
    positions [0, anchor_pos); the anchor (last emitted token) sits at ``anchor_pos``.
    """
    _check(prompt_ids, max_new_tokens)
    res = GenerationResult()
    t0 = time.perf_counter()
    target.reset()
    drafter.reset()
    logits, features = target.forward(prompt_ids, drafter.feature_layers)
    res.prefill_s = time.perf_counter() - t0
    verified = list(prompt_ids)
    done = res.push(_choose(logits[-1], sampling, generator), max_new_tokens, stop_token_ids)
    while not done:
        anchor, anchor_pos = res.tokens[-1], len(verified)
        verified.append(anchor)

        t1 = time.perf_counter()
        draft_logits = drafter.draft_logits(features, anchor, anchor_pos, verified)
        if sampling.greedy:
            draft_probs = None
            drafts = draft_logits.argmax(-1)
        else:
            draft_probs = probs_from_logits(draft_logits, sampling)
            drafts = sample(draft_probs, generator)
        t2 = time.perf_counter()

        logits, block_features = target.forward([anchor, *drafts.tolist()], drafter.feature_layers)
        if sampling.greedy:
            m, nxt = verify_greedy(drafts, logits)
        else:
            m, nxt = verify_rejection(
                drafts, draft_probs, probs_from_logits(logits, sampling), generator
            )
        # Commit the anchor + m accepted drafts on both sides; the new token is next anchor.
        target.crop(anchor_pos + m + 1)
        features = block_features[: m + 1]
        res.verify_s += time.perf_counter() - t2
        res.draft_s += t2 - t1
        res.accepted.append(m)
        res.drafted.append(int(drafts.shape[0]))

        emitted = [*drafts[:m].tolist(), nxt]
        verified.extend(emitted[:-1])
        for i, tok in enumerate(emitted):
            if done := res.push(tok, max_new_tokens, stop_token_ids):
                res.truncated = len(emitted) - i - 1
                break
    res.total_s = time.perf_counter() - t0
    return res
