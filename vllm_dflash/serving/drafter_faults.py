"""A drafter fault never takes the engine down.

Drafts only ever propose: vLLM's verifier decides every token from the target alone. So a
drafting step that raises (bad shapes, a kernel error, a NaN guard, a bug of ours) can be
answered by the step drafting nothing, and the output is what no speculation gives.

* Runner V1 (seam ``v1.runner``, member ``propose_draft_token_ids``): the whole drafting
  step, vLLM's preparation of the drafter's inputs included, runs inside the guard. On a
  fault every request gets no drafts for the next step (empty lists). Under async
  scheduling the scheduler has already reserved K placeholder drafts per request, so they
  get vLLM's own fallback instead, K zeros with no draft probabilities, which the verifier
  treats as any draft it did not sample (lossless, but the zeros are verified: once
  drafting is off, every async step pays for K drafts that rarely land).
* Runner V2 (GPU vLLM's default) is not covered yet: a faulted step there still ends the
  engine. Its drafts are a fixed [requests, K] buffer and, for sampled requests, the
  rejection sampler divides by draft probabilities it caches from the drafter; a fallback
  draft would meet stale probabilities, which is not lossless, and no GPU run here could
  show a fallback that is.

Each fault is counted (``vllm_dflash_drafter_faults_total``, through the step records of
``step_timing.py``); the first fault of each kind is logged with its traceback, later ones
of the same kind in one line. After ``drafter_max_faults`` faults within
``drafter_fault_window_s`` seconds the drafter is switched off for the life of the
process: every later step drafts nothing (gauge ``vllm_dflash_drafter_off``). A drafter
that fails that often is broken, and running it would only cost time.

What the guard cannot catch: a device-side error that poisons the CUDA context (a device
assert) fails every later kernel, the target's too; and under tensor parallelism a fault on
one rank only leaves the ranks' collectives out of step. Both end the engine as before.
After a caught fault the drafter's context K/V for that step's tokens may be missing,
which can lower acceptance for those requests until their context moves on; it never
changes a token.
"""

from __future__ import annotations

import logging
import time
import traceback
from collections import deque
from dataclasses import dataclass, field

import torch
from pydantic import Field

from vllm_dflash.env_settings import EnvSettings

logger = logging.getLogger("vllm.plugins.vllm_dflash")


class FaultSettings(EnvSettings):
    """Read from ``VLLM_DFLASH_<FIELD>`` in every vLLM process."""

    drafter_max_faults: int = Field(
        5,
        ge=1,
        description="the number of drafter faults within the window that switches drafting "
        "off for the life of the engine",
    )
    drafter_fault_window_s: float = Field(
        300.0, gt=0.0, description="the window, in seconds, over which faults are counted"
    )


@dataclass
class FaultGuard:
    """The fault record of one drafter (one per model runner)."""

    settings: FaultSettings
    recent: deque[float] = field(default_factory=deque)  # times of faults in the window
    kinds: dict[str, int] = field(default_factory=dict)  # "Type: message" -> count
    total: int = 0
    off: bool = False

    def failed(self, exc: BaseException, now: float | None = None) -> None:
        """Record a fault; switch drafting off when the window holds too many."""
        now = time.monotonic() if now is None else now
        self.total += 1
        self.recent.append(now)
        while self.recent and now - self.recent[0] > self.settings.drafter_fault_window_s:
            self.recent.popleft()
        kind = f"{type(exc).__name__}: {exc}"[:300]
        seen = self.kinds.get(kind, 0)
        self.kinds[kind] = seen + 1
        if seen == 0:
            logger.error(
                "vllm-dflash: the drafter failed; this step drafts nothing and the output is "
                "unchanged (fault %d, %d in the last %.0f s):\n%s",
                self.total,
                len(self.recent),
                self.settings.drafter_fault_window_s,
                "".join(traceback.format_exception(exc)).rstrip(),
            )
        else:
            logger.warning(
                "vllm-dflash: the drafter failed again (%s, %d times); this step drafts nothing",
                kind,
                seen + 1,
            )
        if not self.off and len(self.recent) >= self.settings.drafter_max_faults:
            self.off = True
            logger.error(
                "vllm-dflash: %d drafter faults within %.0f s: speculation is off for the "
                "life of this engine; requests decode without drafts. Fix the cause above and "
                "restart (VLLM_DFLASH_DRAFTER_MAX_FAULTS / VLLM_DFLASH_DRAFTER_FAULT_WINDOW_S "
                "set the limit)",
                len(self.recent),
                self.settings.drafter_fault_window_s,
            )


def guard_of(owner: object) -> FaultGuard:
    """The guard kept on ``owner`` (a model runner or a speculator), made on first use."""
    g = owner.__dict__.get("_dflash_faults")
    if g is None:
        g = owner.__dict__["_dflash_faults"] = FaultGuard(FaultSettings.from_env())
    return g


def guarded(propose_draft_token_ids):
    """Wraps runner V1's ``propose_draft_token_ids`` (see the module docstring)."""
    from vllm_dflash.serving import step_timing

    def propose_draft_token_ids_guarded(self, *args, **kwargs):
        guard = guard_of(self)
        if not guard.off:
            try:
                return propose_draft_token_ids(self, *args, **kwargs)
            except Exception as exc:
                guard.failed(exc)
                step_timing.note_fault(faulted=True, off=guard.off)
        else:
            step_timing.note_fault(faulted=False, off=True)
        return no_drafts(self)

    return propose_draft_token_ids_guarded


def no_drafts(runner):
    """No drafts for the next step: one empty list per request, or under async scheduling
    (K placeholders already reserved) vLLM's own fallback of K zeros. Without draft
    probabilities the rejection sampler treats a draft as certain, which keeps sampled
    requests lossless for any draft token."""
    runner._draft_probs = None
    runner._draft_prob_req_ids = None
    if runner.use_async_scheduling:
        return torch.zeros(1, dtype=torch.int32, device=runner.device).expand(
            runner.input_batch.num_reqs, runner.num_spec_tokens
        )
    return [[] for _ in runner.input_batch.req_ids]
