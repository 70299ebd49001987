"""The no-speculation baseline behind the per-request speedup metric.

Speedup of a request = its decode rate / the decode rate the same engine achieves
*without* speculation at the same batch size. That rate is measured, not assumed: now and
then the engine runs one step in which no request verifies drafts (a *baseline step*,
``serving/scheduler_hooks.py``). The model runner's time for that step outside the drafter
(which still drafts for the next step) is one sample of the no-speculation step time at
that step's decode batch size.

``SamplePolicy`` decides which steps are baseline steps: often while a batch size has few
samples, then once every ``every`` steps, never two within ``min_gap`` steps. A baseline
step costs one step of speculation for the requests in it (about 1/every of the steps,
1 % at the default). None is taken during the engine's first ``warmup`` steps, which run
slower than the steady state. ``BaselineTable`` keeps the recent samples per batch-size bucket
and answers with their median, interpolated linearly between measured buckets.

Error of the method (measured by the benchmark in docs/observability.md): the engine loop around the
runner (scheduling, output handling: ~0.3 ms per step on the CPU test machine, overlapped
with the GPU under async scheduling) is not in the sample, which makes the speedup a few
percent low; work that only a speculating engine does between steps (fetching the drafts
from the worker) stays in the request's own decode time, where it belongs.
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections import deque

from pydantic import Field

from vllm_dflash.env_settings import EnvSettings


class MetricsSettings(EnvSettings):
    """Read from ``VLLM_DFLASH_<FIELD>`` environment variables in every vLLM process."""

    baseline_every: int = Field(100, ge=0, description="steps between baseline steps; 0: off")
    baseline_warmup: int = Field(100, ge=0, description="engine steps before the first one")
    baseline_min_gap: int = Field(16, ge=1, description="fewest steps between two baselines")
    baseline_samples: int = Field(8, ge=1, description="samples a bucket needs before it waits")
    acceptance_floor: float = Field(1.5, ge=1.0, description="alert floor for mean tau")


def bucket(batch: int) -> int:
    """Batch sizes 1..8 are their own bucket; above, powers of two (9..16 -> 16)."""
    if batch <= 8:
        return max(batch, 1)
    return 1 << math.ceil(math.log2(batch))


class SamplePolicy:
    def __init__(self, settings: MetricsSettings) -> None:
        self.s = settings
        self.counts: dict[int, int] = {}
        self.last = -(10**9)

    def due(self, step: int, batch: int) -> bool:
        """Whether ``step``, with ``batch`` decoding requests, should be a baseline step."""
        if self.s.baseline_every == 0 or batch == 0 or step <= self.s.baseline_warmup:
            return False
        since = step - self.last
        if since < self.s.baseline_min_gap:
            return False
        return (
            self.counts.get(bucket(batch), 0) < self.s.baseline_samples
            or since >= self.s.baseline_every
        )

    def taken(self, step: int, batch: int) -> None:
        self.last = step
        self.counts[bucket(batch)] = self.counts.get(bucket(batch), 0) + 1


class BaselineTable:
    """Recent no-speculation step times per batch-size bucket."""

    def __init__(self, keep: int = 16) -> None:
        self.samples: dict[int, deque[float]] = {}
        self.keep = keep

    def add(self, batch: int, seconds: float) -> None:
        if batch > 0 and seconds > 0:
            self.samples.setdefault(bucket(batch), deque(maxlen=self.keep)).append(seconds)

    def medians(self) -> dict[int, float]:
        return {b: statistics.median(s) for b, s in sorted(self.samples.items())}

    def step_seconds(self, batch: float) -> float | None:
        """No-speculation seconds per decode step at ``batch`` (a mean may be fractional);
        None until any sample exists. Outside the measured range: the nearest bucket."""
        med = self.medians()
        if not med:
            return None
        xs = list(med)
        i = bisect.bisect_left(xs, batch)
        if i == 0:
            return med[xs[0]]
        if i == len(xs):
            return med[xs[-1]]
        lo, hi = xs[i - 1], xs[i]
        w = (batch - lo) / (hi - lo)
        return med[lo] * (1 - w) + med[hi] * w


class RequestCounters:
    """Per-request counts kept by the API server while the request decodes."""

    __slots__ = ("verify_steps", "verify_tokens", "batch_sum")

    def __init__(self) -> None:
        self.verify_steps = 0
        self.verify_tokens = 0
        self.batch_sum = 0

    def acceptance_length(self) -> float | None:
        """Tokens emitted per verify step (1 = no draft accepted)."""
        return self.verify_tokens / self.verify_steps if self.verify_steps else None

    def mean_batch(self) -> float | None:
        return self.batch_sum / self.verify_steps if self.verify_steps else None


def request_speedup(
    decode_tokens: int, decode_seconds: float, mean_batch: float | None, table: BaselineTable
) -> float | None:
    """Decode rate of the request over the measured no-speculation rate at its batch size."""
    if decode_tokens <= 0 or decode_seconds <= 0 or mean_batch is None:
        return None
    base = table.step_seconds(mean_batch)
    if base is None:
        return None
    return decode_tokens / decode_seconds * base
