"""Engine-side measurements for our metrics, carried to the API server on vLLM's stats path.

vLLM sends one ``SchedulerStats`` per engine step from the engine core to the API server,
where stat loggers (ours: ``stat_logger.py``) receive it. We add one field to it,
``dflash``, filled here per step:

* ``drafter_s`` / ``verify_s``: the model runner's time in the proposer, and the rest of
  its step (target forward, sampling / rejection sampling, bookkeeping). Timed around the
  runner's methods, so any proposer is timed, vLLM's built-in one too. On CPU with
  ``perf_counter``; on CUDA with events read once they have completed (never a sync), so a
  step's numbers may travel with a later step.
* ``no_verify``: this step was a *baseline step*: the scheduler dropped every request's
  drafts before scheduling it, so it ran as plain decoding (``observability/baseline.py``).
* ``baseline``: ``[decode batch, seconds]`` for each plain decode step the runner ran (no
  draft to verify, one token per request, no prefill): its time outside the drafter, which
  still drafts for the next step. That is the runner's time for a decode step without
  speculation; the engine loop around it (tens of microseconds to ~0.3 ms here) is left out.

Everything is installed by ``install()`` in every vLLM process, whichever backend serves.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch

from vllm_dflash.observability.baseline import MetricsSettings, SamplePolicy
from vllm_dflash.serving.install import after_import

FIELD = "dflash"
RUNNER_MODULE = "vllm.v1.worker.gpu_model_runner"
SCHEDULER_MODULE = "vllm.v1.core.sched.scheduler"
STATS_MODULE = "vllm.v1.metrics.stats"


def install() -> None:
    MetricsSettings.from_env()  # a bad VLLM_DFLASH_* value stops the start, naming it
    after_import(STATS_MODULE, _add_stats_field)
    after_import(RUNNER_MODULE, _time_runner)
    after_import(SCHEDULER_MODULE, _hook_scheduler)


# ---- the extra SchedulerStats field ---------------------------------------------------
def _add_stats_field(stats_module: Any) -> None:
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


# ---- model runner: drafter vs verify time ---------------------------------------------
class _Clock:
    """Wall clock on CPU; CUDA events on a GPU, read only once completed."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def ready(self, mark: Any) -> bool:
        return not self.cuda or mark.query()

    def seconds(self, a: Any, b: Any) -> float:
        return b - a if not self.cuda else a.elapsed_time(b) / 1000.0


class _RunnerTimes:
    def __init__(self, device: torch.device) -> None:
        self.clock = _Clock(device)
        self.step: dict[str, Any] = {}
        self.pending: list[dict[str, Any]] = []  # finished steps whose marks may be in flight

    def resolved(self) -> list[dict[str, Any]]:
        """Every pending step whose last mark has completed, as a record: ``drafter_s``,
        ``verify_s``, ``plain`` (decode batch of a plain decode step, else 0) and what the
        step ran (see ``_step_shape``)."""
        out, keep = [], []
        for s in self.pending:
            if not self.clock.ready(s["end"]):
                keep.append(s)
                continue
            total = self.clock.seconds(s["start"], s["end"])
            draft = sum(self.clock.seconds(a, b) for a, b in s["drafts"])
            out.append({"drafter_s": draft, "verify_s": max(total - draft, 0.0), **s["shape"]})
        self.pending = keep
        return out


def _step_shape(so: Any) -> dict[str, Any]:
    """What a step ran: ``batch`` requests; ``decode_only`` when each computes just its
    verified token plus its drafts (no prefill); ``verify_gamma``, the drafts verified per
    request (mean, rounded); ``draft_gamma``, the drafts it proposes for the next step;
    ``plain``, the batch when it is a plain decode step (nothing verified), else 0."""
    n = len(so.num_scheduled_tokens)
    drafts = sum(map(len, so.scheduled_spec_decode_tokens.values()))
    decode_only = n > 0 and so.total_num_scheduled_tokens == n + drafts
    return {
        "batch": n,
        "decode_only": decode_only,
        "verify_gamma": round(drafts / n) if n else 0,
        "draft_gamma": getattr(so, "num_spec_tokens_to_schedule", 0),
        "plain": n if decode_only and not drafts else 0,
    }


def _time_runner(runner_module: Any) -> None:
    cls = runner_module.GPUModelRunner
    if getattr(cls.execute_model, "_vllm_dflash", False):
        return
    execute, sample, propose = cls.execute_model, cls.sample_tokens, cls.propose_draft_token_ids
    empty = runner_module.EMPTY_MODEL_RUNNER_OUTPUT

    def times(self) -> _RunnerTimes | None:
        if not self.speculative_config:
            return None
        t = self.__dict__.get("_dflash_times")
        if t is None:
            t = self._dflash_times = _RunnerTimes(self.device)
        return t

    def execute_model(self, scheduler_output, *args, **kwargs):
        if (t := times(self)) is not None:
            t.step = {"start": t.clock.mark(), "drafts": [], "shape": _step_shape(scheduler_output)}
        return execute(self, scheduler_output, *args, **kwargs)

    def propose_draft_token_ids(self, *args, **kwargs):
        t = times(self)
        if t is None or "start" not in t.step:
            return propose(self, *args, **kwargs)
        a = t.clock.mark()
        try:
            return propose(self, *args, **kwargs)
        finally:
            t.step["drafts"].append((a, t.clock.mark()))

    def sample_tokens(self, *args, **kwargs):
        out = sample(self, *args, **kwargs)
        t = times(self)
        if t is None or "start" not in t.step:
            return out
        t.step["end"] = t.clock.mark()
        t.pending.append(t.step)
        t.step = {}
        target = getattr(out, "_model_runner_output", out)  # async scheduling wraps it
        if target is not empty and hasattr(target, "sampled_token_ids"):
            target.dflash_timings = t.resolved()
        return out

    for f in (execute_model, propose_draft_token_ids, sample_tokens):
        f._vllm_dflash = True  # type: ignore[attr-defined]
    cls.execute_model = execute_model
    cls.propose_draft_token_ids = propose_draft_token_ids
    cls.sample_tokens = sample_tokens


# ---- scheduler: baseline steps and the per-step payload -------------------------------
class _SchedulerState:
    def __init__(self) -> None:
        self.policy = SamplePolicy(MetricsSettings.from_env())
        self.step = 0
        self.no_verify: set[int] = set()  # ids of SchedulerOutputs scheduled without drafts
        self.carry: list[list[float]] = []  # baseline samples waiting for a stats object


def _hook_scheduler(sched_module: Any) -> None:
    cls = sched_module.Scheduler
    if getattr(cls.schedule, "_vllm_dflash", False):
        return
    schedule, update = cls.schedule, cls.update_from_output

    def state(self) -> _SchedulerState | None:
        if not self.num_spec_tokens or not self.log_stats:
            return None
        st = self.__dict__.get("_dflash_state")
        if st is None:
            st = self._dflash_state = _SchedulerState()
        return st

    def schedule_(self, *args, **kwargs):
        st = state(self)
        if st is None:
            return schedule(self, *args, **kwargs)
        st.step += 1
        batch = sum(1 for r in self.running if not r.is_prefill_chunk)
        due = not self.waiting and st.policy.due(st.step, batch)
        if due:
            for r in self.running:
                r.spec_token_ids = []  # verifies nothing this step: plain decoding
        out = schedule(self, *args, **kwargs)
        if due:
            st.no_verify.add(id(out))
            st.policy.taken(st.step, batch)
        return out

    def update_from_output(self, scheduler_output, model_runner_output):
        st = state(self)
        if st is None:
            return update(self, scheduler_output, model_runner_output)
        timings = getattr(model_runner_output, "dflash_timings", None) or []
        outputs = update(self, scheduler_output, model_runner_output)
        payload: dict[str, Any] = {}
        if timings:
            payload["drafter_s"] = [t["drafter_s"] for t in timings]
            payload["verify_s"] = [t["verify_s"] for t in timings]
        baseline = st.carry + [[t["plain"], t["verify_s"]] for t in timings if t["plain"]]
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

    schedule_._vllm_dflash = True  # type: ignore[attr-defined]
    cls.schedule = schedule_
    cls.update_from_output = update_from_output
