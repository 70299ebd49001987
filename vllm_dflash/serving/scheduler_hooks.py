"""Our part of vLLM's scheduler (engine core): each of its methods wrapped once (seam
``scheduler``), everything the scheduler does for us in one place.

* ``__init__``: by default each request's draft length comes from our draft policy
  (``draft_plan.py``); with ``VLLM_DFLASH_ADAPTIVE=1`` the per-step draft length comes from
  our controller (``adaptive_draft_len.py``) instead of vLLM's batch-size lookup.
* ``schedule``: drafts are cut to the policy's lengths before scheduling, and the next
  lengths planned after it. Now and then a *baseline step*: every request's drafts are
  dropped before scheduling (none while a seeded request runs, see
  ``adaptive/policy.py``), so the step runs as plain decoding and its time is a sample of
  the no-speculation step time (``observability/baseline.py``).
* ``update_from_output``: the runner's ``StepTiming`` records (``step_timing.py``) go to
  the controller, to the draft policy together with the whole engine loop's time (taken at
  the next ``schedule``, ``draft_plan.observe_costs``), and, as the per-step payload, into
  the ``SchedulerStats`` vLLM sends to the API server, in one added dataclass field (seam
  ``scheduler_stats``), where our stat logger reads them (``stat_logger.py``). The payload
  is a plain dict: it crosses vLLM's msgpack transport.

  * ``drafter_s`` / ``verify_s``: per step, the runner's time in our drafter and the rest;
  * ``baseline``: ``[decode batch, seconds]`` for each plain decode step (nothing verified):
    its time outside the drafter, which still drafts for the next step;
  * ``no_verify``: this step was a baseline step;
  * ``drafter_faults`` / ``drafter_off``: drafting steps that raised, and whether drafting
    is switched off (``drafter_faults.py``).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from vllm_dflash.adaptive.controller import DraftLenController
from vllm_dflash.adaptive.policy import DraftPolicy
from vllm_dflash.observability.baseline import MetricsSettings, SamplePolicy
from vllm_dflash.serving import adaptive_draft_len, draft_plan
from vllm_dflash.serving.seams import SEAMS, patch
from vllm_dflash.serving.step_timing import ATTR, StepTiming

FIELD = "dflash"

logger = logging.getLogger("vllm.plugins.vllm_dflash")


@dataclass
class SchedulerState:
    """What our hooks keep per scheduler."""

    policy: SamplePolicy | None  # baseline steps; None when the engine logs no stats
    controller: DraftLenController | None  # the adaptive draft length; None when off
    drafts: DraftPolicy | None  # the per-request draft policy; None when not served
    lengths: dict[str, int] = field(default_factory=dict)  # planned at the previous step
    step: int = 0
    no_verify: set[int] = field(default_factory=set)  # ids of outputs scheduled without drafts
    carry: list[list[float]] = field(default_factory=list)  # baseline samples not yet sent
    started: float | None = None  # when the current step's schedule began
    costs: list[StepTiming] = field(default_factory=list)  # its runner records, for the policy


def install() -> None:
    patch.after_import(SEAMS["scheduler_stats"].module, _declare_stats_field)
    patch.wrap("scheduler", _init, member="__init__")
    patch.wrap("scheduler", _schedule, member="schedule")
    patch.wrap("scheduler", _update, member="update_from_output")


def _declare_stats_field(stats_module: Any) -> None:
    """Declare ``SchedulerStats.dflash`` so vLLM's msgpack encoder sends it and the API
    server's decoder keeps it. Must run before either is built; the plugin loads first."""
    cls = stats_module.SchedulerStats
    if FIELD in cls.__dataclass_fields__:
        return
    f = dataclasses.field(default=None)
    f.name, f.type = FIELD, dict[str, Any] | None
    f._field_type = dataclasses._FIELD  # type: ignore[attr-defined]
    cls.__dataclass_fields__[FIELD] = f
    cls.__annotations__[FIELD] = f.type
    setattr(cls, FIELD, None)

    def undo() -> None:
        del cls.__dataclass_fields__[FIELD]
        del cls.__annotations__[FIELD]
        delattr(cls, FIELD)

    patch.changed_elsewhere(f"SchedulerStats.{FIELD}", undo)


def _state(scheduler: Any) -> SchedulerState | None:
    return scheduler.__dict__.get("_dflash")


def _init(init):
    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        spec = self.vllm_config.speculative_config
        if not (spec and spec.method == "dflash" and self.num_spec_tokens):
            return
        policy = SamplePolicy(MetricsSettings.from_env()) if self.log_stats else None
        self._dflash = SchedulerState(
            policy, adaptive_draft_len.controller_for(self), draft_plan.policy_for(self)
        )

    return __init__


def _schedule(schedule):
    def schedule_with_baselines(self, *args, **kwargs):
        st = _state(self)
        if st is None:
            return schedule(self, *args, **kwargs)
        if st.drafts is not None:
            now = time.perf_counter()
            if st.started is not None:  # the previous step's whole loop is over
                draft_plan.observe_costs(st.drafts, st.costs, now - st.started)
            st.started, st.costs = now, []
            draft_plan.cut_drafts(self.running, st.lengths)
        due = False
        if st.policy is not None:
            st.step += 1
            batch = sum(1 for r in self.running if not r.is_prefill_chunk)
            # A seeded request's drafts are never dropped (adaptive/policy.py): its
            # tokens must not depend on when baselines fall, so baselines wait for it.
            due = (
                not self.waiting
                and not any(draft_plan.seeded(r) for r in self.running)
                and st.policy.due(st.step, batch)
            )
        if due:
            for r in self.running:
                r.spec_token_ids = []  # verifies nothing this step: plain decoding
        out = schedule(self, *args, **kwargs)
        if st.drafts is not None:
            st.lengths = draft_plan.plan_step(st.drafts, self, out)
        if due:
            st.no_verify.add(id(out))
            st.policy.taken(st.step, batch)
        return out

    return schedule_with_baselines


def _update(update):
    def update_from_output(self, scheduler_output, model_runner_output):
        st = _state(self)
        if st is None:
            return update(self, scheduler_output, model_runner_output)
        timings: list[StepTiming] = getattr(model_runner_output, ATTR, None) or []
        if st.controller is not None:
            adaptive_draft_len.observe(
                st.controller, scheduler_output, model_runner_output, timings
            )
        if st.drafts is not None:
            draft_plan.observe(st.drafts, scheduler_output, model_runner_output)
            st.costs += timings  # observed once the loop's time is known (next schedule)
        outputs = update(self, scheduler_output, model_runner_output)
        if st.policy is None:
            return outputs
        payload: dict[str, Any] = {}
        if timings:
            payload["drafter_s"] = [t.drafter_s for t in timings]
            payload["verify_s"] = [t.verify_s for t in timings]
        if faults := sum(t.drafter_faults for t in timings):
            payload["drafter_faults"] = faults
        if any(t.drafter_off for t in timings):
            payload["drafter_off"] = True
        baseline = st.carry + [[t.plain, t.verify_s] for t in timings if t.plain]
        if baseline:
            payload["baseline"] = baseline
        if id(scheduler_output) in st.no_verify:
            st.no_verify.discard(id(scheduler_output))
            payload["no_verify"] = True
        stats = next((o.scheduler_stats for o in outputs.values() if o.scheduler_stats), None)
        if stats is not None and payload:
            setattr(stats, FIELD, payload)
        st.carry = [] if stats is not None else baseline  # keep samples for the next step
        return outputs

    return update_from_output
