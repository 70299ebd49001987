"""Runs checks one by one: a failing check is recorded with its traceback and the run goes
on; one flushed progress line per check; checks past the time budget are skipped."""

from __future__ import annotations

import contextlib
import gc
import time
import traceback
from collections.abc import Callable

import torch

from vllm_dflash.gpu_check.results import (
    Check,
    CheckFailed,
    CheckSkipped,
    Outcome,
    PartResult,
)


class Runner:
    def __init__(self, budget_s: float, on_part_done: Callable[[], None] | None = None):
        self.start = time.monotonic()
        self.budget_s = budget_s
        self.on_part_done = on_part_done  # writes the report so far (a later hang loses less)
        self.current = ""  # the check in progress, for the watchdog's message
        self.current_part: PartResult | None = None

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def say(self, msg: str) -> None:
        print(f"[gpu-check {self.elapsed():6.1f}s] {msg}", flush=True)

    def out_of_time(self) -> bool:
        return self.elapsed() > self.budget_s

    def check(
        self,
        part: PartResult,
        name: str,
        body: Callable[[], Outcome | None],
        *,
        skip: str | None = None,
    ) -> Check:
        """Run ``body`` as the sub-check ``name`` of ``part`` (or record it skipped)."""
        self.current = f"({part.key}) {name}"
        t0 = time.monotonic()
        if skip is None and self.out_of_time():
            skip = f"time budget of {self.budget_s:.0f} s spent"
        if skip is not None:
            check = Check(name, "skipped", detail=skip)
        else:
            try:
                out = body() or Outcome()
                check = Check(name, "ok", detail=out.detail, metrics=out.metrics)
            except CheckFailed as e:
                check = Check(name, "failed", detail=e.detail, metrics=e.metrics)
            except CheckSkipped as e:
                check = Check(name, "skipped", detail=str(e))
            except Exception as e:  # noqa: BLE001  (record every error and go on)
                check = Check(
                    name,
                    "failed",
                    detail=f"{type(e).__name__}: {_first_line(e)}",
                    traceback=traceback.format_exc(),
                )
            check.seconds = time.monotonic() - t0
        part.checks.append(check)
        line = f"({part.key}) {name}: {check.status} ({check.seconds:.2f}s)"
        self.say(f"{line} {check.detail}".rstrip())
        self.current = ""
        return check

    def part(
        self, key: str, title: str, body: Callable[[PartResult], None], results: list[PartResult]
    ) -> PartResult:
        """Run a whole part; an exception outside its checks becomes a failed check "part"."""
        part = PartResult(key, title)
        results.append(part)
        self.current_part = part
        self.say(f"({key}) {title}")
        t0 = time.monotonic()
        try:
            body(part)
        except Exception as e:  # noqa: BLE001
            part.checks.append(
                Check(
                    "part",
                    "failed",
                    detail=f"{type(e).__name__}: {_first_line(e)}",
                    traceback=traceback.format_exc(),
                )
            )
        finally:
            free_memory()
        part.seconds = time.monotonic() - t0
        part.settle()
        self.current_part = None
        self.say(f"({key}) {part.status} ({part.seconds:.1f}s) {part.reason}".rstrip())
        if self.on_part_done is not None:
            self.on_part_done()
        return part


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        # A kernel fault poisons the context; the checks after it say so themselves.
        with contextlib.suppress(RuntimeError):
            torch.cuda.empty_cache()


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else repr(e)
