"""Per model-runner step: time in our drafter and the rest, for metrics and the adaptive
draft length.

The runner's ``execute_model`` opens a step and ``sample_tokens`` closes it (seams
``v1.runner`` / ``v2.runner``; on both runners our drafter runs inside ``sample_tokens``).
Our proposer (V1) and speculator (V2) mark their own ``propose`` with ``drafting()``. On CPU
the marks are ``perf_counter`` readings; on CUDA they are events on the current stream, read
only once they have completed (never a sync), so under async scheduling a step's record may
travel with a later step's output. Each closed step becomes a ``StepTiming`` attached to the
step's ``ModelRunnerOutput`` as ``dflash_timings`` (the engine core's scheduler reads it,
``scheduler_hooks.py``).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from vllm_dflash.serving import draft_plan
from vllm_dflash.serving.seams import patch

ATTR = "dflash_timings"


@dataclass(frozen=True)
class StepTiming:
    """One runner step: what it ran and where its time went."""

    batch: int  # requests in the step
    decode_only: bool  # each request computed its verified token plus its drafts, no prefill
    verified_len: int  # drafts verified per request (mean, rounded)
    drafted_len: int  # drafts per request the scheduler asked for the next step
    plain: int  # the batch, when the step verified nothing (plain decoding); else 0
    drafting: int = 0  # requests the drafter drafts for in this step
    verified: int = 0  # drafts verified in this step, all requests together
    drafter_s: float = 0.0  # in our proposer's propose
    verify_s: float = 0.0  # the rest: target forward, rejection sampling, bookkeeping
    drafter_faults: int = 0  # drafting that raised in this step (``drafter_faults.py``)
    drafter_off: bool = False  # drafting is switched off after too many faults

    @classmethod
    def of(cls, scheduler_output: Any) -> StepTiming:
        so = scheduler_output
        n = len(so.num_scheduled_tokens)
        drafts = sum(map(len, so.scheduled_spec_decode_tokens.values()))
        decode_only = n > 0 and so.total_num_scheduled_tokens == n + drafts
        return cls(
            batch=n,
            decode_only=decode_only,
            verified_len=round(drafts / n) if n else 0,
            drafted_len=getattr(so, "num_spec_tokens_to_schedule", 0) or 0,
            plain=n if decode_only and not drafts else 0,
            drafting=draft_plan.drafting(so, n),
            verified=drafts,
        )


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


@dataclass
class _Step:
    shape: StepTiming
    start: Any
    drafts: list[tuple[Any, Any]] = field(default_factory=list)
    end: Any = None
    faults: int = 0
    off: bool = False


class RunnerTimes:
    def __init__(self, device: torch.device) -> None:
        self.clock = _Clock(device)
        self.step: _Step | None = None
        self.pending: list[_Step] = []  # closed steps whose marks may be in flight

    def resolved(self) -> list[StepTiming]:
        """Every closed step whose last mark has completed."""
        out, keep = [], []
        for s in self.pending:
            if not self.clock.ready(s.end):
                keep.append(s)
                continue
            total = self.clock.seconds(s.start, s.end)
            draft = sum(self.clock.seconds(a, b) for a, b in s.drafts)
            out.append(
                dataclasses.replace(
                    s.shape,
                    drafter_s=draft,
                    verify_s=max(total - draft, 0.0),
                    drafter_faults=s.faults,
                    drafter_off=s.off,
                )
            )
        self.pending = keep
        return out


_ACTIVE: RunnerTimes | None = None  # the runner of this process, once it has run a step


@contextmanager
def drafting() -> Iterator[None]:
    """Marks the time our drafter takes inside the current runner step."""
    times = _ACTIVE
    step = None if times is None else times.step
    if step is None:
        yield
        return
    assert times is not None
    a = times.clock.mark()
    try:
        yield
    finally:
        step.drafts.append((a, times.clock.mark()))


def note_fault(faulted: bool, off: bool) -> None:
    """Marks the current step: its drafting raised, and whether drafting is now off
    (``drafter_faults.py``)."""
    step = None if _ACTIVE is None else _ACTIVE.step
    if step is not None:
        step.faults += faulted
        step.off = off


def install(runner: str) -> None:
    seam = f"{runner}.runner"
    patch.wrap(seam, _opening_step, member="execute_model")
    patch.wrap(seam, _closing_step, member="sample_tokens")


def _times(runner: Any) -> RunnerTimes | None:
    global _ACTIVE
    if not runner.speculative_config:
        return None
    t = runner.__dict__.get("_dflash_times")
    if t is None:
        t = runner._dflash_times = RunnerTimes(runner.device)
    _ACTIVE = t
    return t


def _opening_step(execute_model):
    def execute_model_timed(self, scheduler_output, *args, **kwargs):
        draft_plan.runner_step(scheduler_output)
        if (t := _times(self)) is not None:
            t.step = _Step(StepTiming.of(scheduler_output), t.clock.mark())
        return execute_model(self, scheduler_output, *args, **kwargs)

    return execute_model_timed


def _closing_step(sample_tokens):
    def sample_tokens_timed(self, *args, **kwargs):
        out = sample_tokens(self, *args, **kwargs)
        t = _times(self)
        if t is None or t.step is None:
            return out
        t.step.end = t.clock.mark()
        t.pending.append(t.step)
        t.step = None
        target = inner_output(out)
        if target is not None:  # else the records wait for the next step's output
            setattr(target, ATTR, t.resolved())
        return out

    return sample_tokens_timed


def inner_output(out: Any) -> Any | None:
    """The ``ModelRunnerOutput`` of a step's return value: itself, or the one inside an
    async output (seams ``v1.async_output`` / ``v2.async_output``); None for an output
    that carries nothing per request (vLLM's shared empty output)."""
    for name in ("_model_runner_output", "model_runner_output"):
        inner = getattr(out, name, None)
        if inner is not None:
            out = inner
            break
    if out is None or not hasattr(out, "sampled_token_ids") or not getattr(out, "req_ids", ()):
        return None
    return out
