"""What one timed pass of a benchmark engine reports: written by the engine process
(``engine_worker.py``) as one JSON line, read back by the comparison (``compare_backends``)
and the cost sweep (``sweep``)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from vllm_dflash.adaptive.controller import StepRecord


@dataclass
class SpecCounters:
    """vLLM's own counters (summed over labels), or what a pass added to them."""

    drafts: int = 0  # verifications: one per request per step that carried drafts
    draft_tokens: int = 0
    accepted: int = 0
    preemptions: int = 0
    prefix_hits: int = 0  # prompt tokens served from the prefix cache
    per_pos: list[int] = field(default_factory=list)  # accepted tokens by draft position

    def minus(self, before: SpecCounters) -> SpecCounters:
        prev = before.per_pos + [0] * (len(self.per_pos) - len(before.per_pos))
        return SpecCounters(
            drafts=self.drafts - before.drafts,
            draft_tokens=self.draft_tokens - before.draft_tokens,
            accepted=self.accepted - before.accepted,
            preemptions=self.preemptions - before.preemptions,
            prefix_hits=self.prefix_hits - before.prefix_hits,
            per_pos=[a - b for a, b in zip(self.per_pos, prev, strict=True)],
        )

    @property
    def acceptance_length(self) -> float | None:
        """Tokens per verification, the bonus token included; None without drafts."""
        return 1 + self.accepted / self.drafts if self.drafts else None


@dataclass
class TimedPass:
    """One pass over the prompts at a fixed concurrency."""

    concurrency: int
    seconds: float
    outputs: list[list[int]]  # token ids per prompt, in prompt order
    spec: SpecCounters
    ttft: list[float] = field(default_factory=list)  # seconds, per request
    tpot: list[float] = field(default_factory=list)  # seconds per output token after the first
    drafter_s: list[float] = field(default_factory=list)  # per drafting step
    steps: list[StepRecord] | None = None  # the cost sweep's per-step record

    @property
    def tokens_per_s(self) -> float:
        return sum(map(len, self.outputs)) / self.seconds

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> TimedPass:
        steps = d.get("steps")
        steps = None if steps is None else [StepRecord(**s) for s in steps]
        return cls(**d | {"spec": SpecCounters(**d["spec"]), "steps": steps})
