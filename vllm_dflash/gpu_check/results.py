"""What the GPU check records: one PartResult per part, made of Checks and Tables."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

Status = Literal["ok", "failed", "skipped"]


@dataclass
class Check:
    """One sub-check: ran and passed (ok), ran and did not (failed), or did not run."""

    name: str
    status: Status
    seconds: float = 0.0
    detail: str = ""  # ok: a summary; failed / skipped: the reason
    metrics: dict[str, Any] = field(default_factory=dict)
    traceback: str | None = None  # an exception inside the check (a kit or op error)


@dataclass
class Table:
    title: str
    columns: list[str]
    rows: list[list[Any]]
    note: str = ""


@dataclass
class PartResult:
    key: str  # "a", "b", "c"
    title: str
    status: Status = "skipped"
    reason: str = ""
    seconds: float = 0.0
    checks: list[Check] = field(default_factory=list)
    tables: list[Table] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)

    def settle(self) -> None:
        """Derive the part's status from its checks, unless the part already set one with a
        reason: failed if any check failed, ok if any ran, else skipped."""
        if self.reason and self.status != "ok":
            return
        statuses = {c.status for c in self.checks}
        failed = [c for c in self.checks if c.status == "failed"]
        if failed:
            self.status = "failed"
            self.reason = "; ".join(f"{c.name}: {c.detail}" for c in failed[:3]) + (
                f"; and {len(failed) - 3} more" if len(failed) > 3 else ""
            )
        elif "ok" in statuses:
            self.status = "ok"
        else:
            self.status = "skipped"
            self.reason = self.reason or next((c.detail for c in self.checks), "nothing ran")


class CheckFailed(Exception):
    """Raised by a check body: the check ran and its result is wrong (no traceback kept)."""

    def __init__(self, detail: str, metrics: dict[str, Any] | None = None):
        super().__init__(detail)
        self.detail = detail
        self.metrics = metrics or {}


class CheckSkipped(Exception):
    """Raised by a check body: the check cannot run here (the reason is recorded)."""


@dataclass
class Outcome:
    """What a check body returns when it passed."""

    detail: str = ""
    metrics: dict[str, Any] = field(default_factory=dict)
