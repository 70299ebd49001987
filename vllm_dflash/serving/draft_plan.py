"""The draft-length policy (``adaptive/policy.py``) between vLLM's scheduler and the drafter.

Drafts made in step N are verified in step N+1. So, in the engine core's scheduler:

* before ``schedule`` (step N+1), each request's drafts are cut to the length the policy
  gave it at step N (none for a request that did not draft). Under async scheduling they
  are the placeholders vLLM reserved for drafts still on the device; cut by slicing,
  since vLLM 0.32 / 0.33 share one placeholder list between requests;
* after it, the policy plans step N+1, and the plan goes where the runner reads it:

  * runner V1 (our proposer): on the ``SchedulerOutput`` as ``dflash_draft_lengths``
    (request id -> length, only requests that draft), which reaches the model runner with
    the output (a plain attribute of a dataclass: it survives vLLM's pickling to worker
    processes). Our proposer drafts for those rows only (``rows``);
  * runner V2 (vLLM's DFlash orchestration, captured in CUDA graphs, drafts every row or
    none): the step's length, the largest planned, as the output's
    ``num_spec_tokens_to_schedule``, which V2 hands its speculator. At 0 it writes the
    context K/V and skips the block forward (vLLM 0.33+; seam behaviours in
    ``seams/__init__.py``). The policy runs with ``shared_drafter`` there;

* ``update_from_output`` feeds back what each request accepted and what the runner's step
  timing measured (``step_timing.py`` counts the drafting requests with ``drafting``).

Where the policy is not served (``VLLM_DFLASH_DRAFT_POLICY=fixed``, ``VLLM_DFLASH_ADAPTIVE=1``,
runner V1 on a GPU or with async scheduling, runner V2 of vLLM 0.32), no plan is made and
every request drafts the step's length, as vLLM itself does.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

from vllm_dflash.adaptive.controller import AdaptiveSettings
from vllm_dflash.adaptive.policy import DraftPolicy, PolicySettings

ATTR = "dflash_draft_lengths"

logger = logging.getLogger("vllm.plugins.vllm_dflash")


def policy_for(scheduler: Any) -> DraftPolicy | None:
    """The policy for this scheduler, or None where it is not served (logged once)."""
    from vllm_dflash.serving.seams import BEHAVIOURS
    from vllm_dflash.serving.seams.environment import installed, runner_of

    settings = PolicySettings.from_env()
    if settings.draft_policy == "fixed":
        return None
    v2 = runner_of(scheduler.vllm_config) == "v2"
    why = None
    if AdaptiveSettings.from_env().adaptive:
        why = "VLLM_DFLASH_ADAPTIVE=1 chooses one draft length per step instead"
    elif v2 and installed().version not in BEHAVIOURS["v2.speculator_skips_query_at_zero"].versions:
        why = (
            f"vLLM {installed().version}'s runner-V2 DFlash drafts its whole block even at "
            "length 0, so plain steps would save nothing. Fix: vLLM 0.33 or later"
        )
    elif not v2 and scheduler.scheduler_config.async_scheduling:
        why = "async scheduling on runner V1 (not yet verified with per-request lengths)"
    elif not v2 and installed().platform != "cpu":
        why = "runner V1 on a GPU (the policy has not run on one yet)"
    if why is not None:
        logger.info("vllm-dflash: fixed draft length, not the draft policy: %s", why)
        return None
    logger.info(
        "vllm-dflash: draft policy 'auto'%s: each request drafts up to %d tokens where it "
        "pays (VLLM_DFLASH_DRAFT_POLICY=fixed for a fixed length)",
        " (runner V2: the batch drafts together or not at all)" if v2 else "",
        scheduler.num_spec_tokens,
    )
    return DraftPolicy(scheduler.num_spec_tokens, settings, shared_drafter=v2)


def seeded(request: Any) -> bool:
    """Whether the request samples from its own seeded generator."""
    sp = request.sampling_params
    return sp is not None and sp.seed is not None and sp.temperature > 0.0


def cut_drafts(running: list[Any], lengths: dict[str, int]) -> None:
    """Before scheduling: each request verifies at most the length it was planned."""
    for r in running:
        n = lengths.get(r.request_id, 0)
        if len(r.spec_token_ids) > n:
            r.spec_token_ids = r.spec_token_ids[:n]


def plan_step(policy: DraftPolicy, scheduler: Any, out: Any) -> dict[str, int]:
    """After scheduling: the lengths of the requests that decode; attached to ``out``."""
    batch = [
        (rid, seeded(r))
        for rid in out.num_scheduled_tokens
        if not (r := scheduler.requests[rid]).is_prefill_chunk
    ]
    lengths = policy.plan(batch).lengths
    if policy.shared_drafter:
        # Runner V2 drafts the step's length for the whole batch (none at 0); each
        # request's own length travels by cutting its drafts before the next schedule.
        out.num_spec_tokens_to_schedule = max(lengths.values(), default=0)
    else:
        setattr(out, ATTR, {rid: n for rid, n in lengths.items() if n})
    return lengths


def verified(so: Any, mro: Any) -> Iterator[tuple[str, int, int]]:
    """(request id, drafts verified, drafts accepted) for each request that verified drafts
    in the step of scheduler output ``so`` and model-runner output ``mro``."""
    index = {r: i for i, r in enumerate(getattr(mro, "req_ids", None) or ())}
    sampled = getattr(mro, "sampled_token_ids", None) or []
    invalid = so.num_invalid_spec_tokens or {}  # drafts a grammar rejected: not verified
    for rid, drafts in so.scheduled_spec_decode_tokens.items():
        i = index.get(rid)
        if i is not None and i < len(sampled) and sampled[i]:
            yield rid, len(drafts) - invalid.get(rid, 0), len(sampled[i]) - 1


# A step whose engine loop took more than this many times its runner time was not a busy
# loop (the engine waited for requests): only its runner time is a cost sample.
IDLE_LOOP = 3.0


def observe_costs(policy: DraftPolicy, timings: list[Any], loop_s: float | None) -> None:
    """Feed the policy one engine step's costs: the runner's drafter and verify times
    (``step_timing.StepTiming``), plus the rest of the engine loop (scheduling, vLLM's
    per-step bookkeeping, output processing: ``loop_s`` is the time from this step's
    ``schedule`` to the next one's) counted with the verify part, which is where that
    work grows with the drafts a step verifies. The policy then compares the engine's real
    step rates, not just the model runner's."""
    steps = [t for t in timings if t.decode_only and not t.drafter_faults]
    runner = sum(t.drafter_s + t.verify_s for t in timings)
    rest = 0.0
    if loop_s is not None and len(timings) == len(steps) == 1 and loop_s < IDLE_LOOP * runner:
        rest = max(loop_s - runner, 0.0)
    for t in steps:
        policy.observe_step(t.batch, t.drafting, t.drafter_s, t.verified, t.verify_s + rest)


def observe(policy: DraftPolicy, so: Any, mro: Any) -> None:
    for rid, drafted, accepted in verified(so, mro):
        policy.observe_verify(rid, drafted, accepted)
    policy.finished(so.finished_req_ids)


# ---- worker side ------------------------------------------------------------------------
_CURRENT: dict[str, int] | None = None  # the plan of the step the runner is executing
# Requests finished or preempted since the proposer last asked; None: nobody asks.
_GONE: set[str] | None = None


def runner_step(scheduler_output: Any) -> None:
    """Called as the runner opens a step (``step_timing.py``)."""
    global _CURRENT
    _CURRENT = getattr(scheduler_output, ATTR, None)
    if _GONE is not None:
        _GONE.update(scheduler_output.finished_req_ids)
        _GONE.update(scheduler_output.preempted_req_ids or ())


def gone() -> set[str]:
    """Requests whose blocks were freed since the last call: finished or preempted. The
    first call starts the record (a proposer that never asks keeps nothing)."""
    global _GONE
    out, _GONE = _GONE or set(), set()
    return out


def drafting(scheduler_output: Any, batch: int) -> int:
    """Requests that draft in this step: those of the plan (runner V1); without one, all of
    them, or none where the step drafts 0 tokens (runner V2's plain steps)."""
    so = scheduler_output
    plan = getattr(so, ATTR, None)
    if plan is not None:
        return len(plan)
    none = so.num_spec_tokens_to_schedule == 0 or getattr(so, "skip_drafts", False)
    return 0 if none else batch


def nobody_drafts() -> bool:
    """Whether the policy has no request draft in the step the runner is executing."""
    return _CURRENT is not None and not _CURRENT


def rows(req_ids: list[str]) -> list[int] | None:
    """Indices of the rows that draft this step; None: every row."""
    if _CURRENT is None:
        return None
    return [i for i, rid in enumerate(req_ids) if rid in _CURRENT]
