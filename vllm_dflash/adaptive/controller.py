"""Adaptive draft length: how many draft tokens (draft_len) to propose at each engine step.

A verify step that drafts draft_len tokens per request commits tau(draft_len) tokens per request
on average and costs T(b, draft_len) = D(b, draft_len) + V(b, draft_len) seconds at decode batch b:
the drafter's forward that drafts draft_len tokens, then the target forward that verifies them
(1 + draft_len tokens per request) in the next step. Each step the controller picks

    draft_len* = argmax over 1 <= draft_len <= K of  tau(draft_len) / T(b, draft_len)

which is tokens per second per request (docs/architecture.md §4, ``bench/analytic.py``). Both
factors are measured while serving, nothing is assumed:

* ``AcceptanceEstimate``: per-position conditional acceptance a_k = P(draft k accepted |
  drafts 1..k-1 accepted) from every verified request, tau(draft_len) = 1 + sum_{k<=draft_len}
  a_1 * ... * a_k. A DFlash drafter drafts all positions in one forward, so a_k does not
  depend on how many positions are drafted (the paper serves a block-16 drafter at 8).
* ``StepCosts``: D and V per batch-size bucket and draft_len, from the model runner's own timing
  of every pure-decode step (``serving/step_timing.py``): a weighted line in batch size
  within the bucket, interpolated between measured draft_lens. Piecewise-linear in draft_len
  rather than one line because on a GPU cost is flat in draft_len until the device saturates
  and linear after.

Costs are only measured at the draft_lens that run, so some steps are *probes*: at each batch
bucket every draft_len of ``probe_draft_lens(K)`` (1, 2, 4, 8, ..., K) runs until it has
``probe_samples`` measurements, on every other step (the steps between use the nearest
fully measured bucket's costs); after that one step in ``explore_every`` measures a draft_len next
to the current best, whichever was measured longest ago (every fourth time, the stalest
probe draft_len). Probes at K also
keep the acceptance of the late positions current. draft_len = 0 (no drafting) is not offered:
the drafter must still write the target's new context into its cache every step, and
vLLM's zero-draft step is not a path its dynamic speculative decoding tests.

Pure Python: it runs, and is tested, without vLLM (``serving/adaptive_draft_len.py`` wires it
into vLLM's scheduler).
"""

from __future__ import annotations

import bisect
import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from pydantic import Field

from vllm_dflash.env_settings import EnvSettings
from vllm_dflash.observability.baseline import bucket


class AdaptiveSettings(EnvSettings):
    """``VLLM_DFLASH_ADAPTIVE=1`` turns the controller on (vllm-dflash backend only)."""

    adaptive: bool = Field(False, description="1 to choose the draft length per step, 0: fixed")
    adaptive_explore_every: int = Field(
        32, ge=2, description="steps per cost probe once every probe draft_len is measured"
    )
    adaptive_probe_samples: int = Field(
        2, ge=1, description="measurements each probe draft_len needs per batch bucket"
    )
    adaptive_half_life: int = Field(
        2000, ge=10, description="verified drafts after which an acceptance count weighs 1/2"
    )


def probe_draft_lens(k_max: int) -> list[int]:
    """The draft_lens whose costs are measured: roughly geometric, always including K."""
    return [*(g for g in (1, 2, 4, 8, 16, 32) if g < k_max), k_max]


class AcceptanceEstimate:
    """Per-position conditional acceptance with exponential forgetting."""

    def __init__(self, k_max: int, half_life: int, prior: float = 0.5) -> None:
        self.trials = [0.0] * k_max
        self.hits = [0.0] * k_max
        self.keep = 0.5 ** (1.0 / half_life)
        self.prior = prior

    def observe(self, drafted: int, accepted: int) -> None:
        """One request's verification: ``accepted`` of its ``drafted`` drafts (a prefix).
        Position k (1-based) was tried when drafts 1..k-1 were all accepted."""
        for k in range(min(drafted, accepted + 1, len(self.trials))):
            self.trials[k] = self.trials[k] * self.keep + 1.0
            self.hits[k] = self.hits[k] * self.keep + (1.0 if k < accepted else 0.0)

    def forget(self) -> None:
        """One step of forgetting with time rather than with verifies: every count weighs
        what one verify's decay leaves of it."""
        self.trials = [t * self.keep for t in self.trials]
        self.hits = [h * self.keep for h in self.hits]

    def conditional(self) -> list[float]:
        """a_k, with one pseudo-trial of the previous position's estimate as prior, so a
        position never tried inherits its predecessor's acceptance."""
        out, prev = [], self.prior
        for t, h in zip(self.trials, self.hits, strict=True):
            prev = (h + prev) / (t + 1.0)
            out.append(prev)
        return out

    def tau(self) -> list[float]:
        """tau(draft_len) for draft_len = 0..K (tau(0) = 1)."""
        out, c = [1.0], 1.0
        for a in self.conditional():
            c *= a
            out.append(out[-1] + c)
        return out


@dataclass
class _Fit:
    """Seconds against batch size at one draft_len: exponentially weighted least squares.
    A bucket spans batch sizes (9..16 is one), and on a CPU cost grows with each request,
    so a plain average would favour whichever draft_len was last measured at a smaller batch."""

    w: float = 0.0
    b: float = 0.0
    bb: float = 0.0
    t: float = 0.0
    bt: float = 0.0
    samples: int = 0

    def add(self, batch: int, seconds: float, keep: float) -> None:
        self.w = self.w * keep + 1.0
        self.b = self.b * keep + batch
        self.bb = self.bb * keep + batch * batch
        self.t = self.t * keep + seconds
        self.bt = self.bt * keep + batch * seconds
        self.samples += 1

    def at(self, batch: float) -> float:
        mb, mt = self.b / self.w, self.t / self.w
        var = self.bb / self.w - mb * mb
        if var < 0.25:  # every sample at (about) one batch size: no slope to fit
            return mt
        slope = max((self.bt / self.w - mb * mt) / var, 0.0)  # never cheaper with more
        return min(max(mt + slope * (batch - mb), 0.5 * mt), 2.0 * mt)


@dataclass
class _Table:
    """Cost fits per draft_len at one batch bucket."""

    by_draft_len: dict[int, _Fit] = field(default_factory=dict)

    def add(self, draft_len: int, batch: int, seconds: float, keep: float) -> None:
        self.by_draft_len.setdefault(draft_len, _Fit()).add(batch, seconds, keep)

    def at(self, draft_len: int, batch: float) -> float:
        """Interpolated linearly between measured draft_lens, flat beyond them."""
        gs = sorted(self.by_draft_len)
        i = bisect.bisect_left(gs, draft_len)
        if i < len(gs) and gs[i] == draft_len:
            return self.by_draft_len[draft_len].at(batch)
        if i == 0:
            return self.by_draft_len[gs[0]].at(batch)
        if i == len(gs):
            return self.by_draft_len[gs[-1]].at(batch)
        lo, hi = gs[i - 1], gs[i]
        w = (draft_len - lo) / (hi - lo)
        return self.by_draft_len[lo].at(batch) * (1 - w) + self.by_draft_len[hi].at(batch) * w


class StepCosts:
    """Drafter seconds by draft_len drafted and verify seconds by draft_len verified, per bucket."""

    def __init__(self, probes: list[int], keep: float = 0.97) -> None:
        self.draft: dict[int, _Table] = {}
        self.verify: dict[int, _Table] = {}
        self.probes = probes
        self.keep = keep

    def add_draft(self, batch: int, draft_len: int, seconds: float) -> None:
        self.draft.setdefault(bucket(batch), _Table()).add(draft_len, batch, seconds, self.keep)

    def add_verify(self, batch: int, draft_len: int, seconds: float) -> None:
        self.verify.setdefault(bucket(batch), _Table()).add(draft_len, batch, seconds, self.keep)

    def samples(self, batch: int, draft_len: int) -> int:
        """Measurements of the pair (draft at draft_len, verify at draft_len) at this bucket."""
        b = bucket(batch)
        d, v = self.draft.get(b), self.verify.get(b)
        fd = d.by_draft_len.get(draft_len) if d else None
        fv = v.by_draft_len.get(draft_len) if v else None
        return min(fd.samples, fv.samples) if fd and fv else 0

    def complete(self, b: int) -> bool:
        """Bucket ``b`` has both costs at every probe draft_len."""
        return all(self.samples(b, g) > 0 for g in self.probes)

    def curve(self, batch: int) -> Callable[[int], float] | None:
        """draft_len -> D + V at this batch; a bucket not fully measured yet borrows the
        nearest complete one (in log batch size) until its own probes are in."""
        own = bucket(batch)
        if not self.complete(own):
            done = [b for b in self.draft if self.complete(b)]
            if not done:
                return None
            own = min(done, key=lambda m: (abs(math.log(m / bucket(batch))), m))
        d, v = self.draft[own], self.verify[own]
        return lambda draft_len: d.at(draft_len, batch) + v.at(draft_len, batch)

    def seconds(self, batch: int, draft_len: int) -> float | None:
        f = self.curve(batch)
        return None if f is None else f(draft_len)


@dataclass
class Choice:
    draft_len: int
    probe: bool


@dataclass(frozen=True)
class StepRecord:
    """One measured pure-decode step, as the benchmark's cost sweep records it."""

    batch: int  # requests in the step
    drafted_len: int  # draft tokens per request the drafter proposed (0: none)
    drafter_s: float  # drafter forward, seconds
    verified_len: int  # draft tokens per request the target verified (0: a plain step)
    verify_s: float  # target forward, seconds


class DraftLenController:
    def __init__(
        self,
        k_max: int,
        settings: AdaptiveSettings | None = None,
        probes: list[int] | None = None,
    ) -> None:
        if k_max < 1:
            raise ValueError(f"k_max = {k_max}: need at least one draft token")
        self.k_max = k_max
        self.s = settings or AdaptiveSettings(adaptive=True)
        self.acceptance = AcceptanceEstimate(k_max, self.s.adaptive_half_life)
        self.probes = probes or probe_draft_lens(k_max)
        self.costs = StepCosts(self.probes)
        self.step = 0
        self.explorations = 0
        self.last_probe: dict[tuple[int, int], int] = {}  # (bucket, draft_len) -> step
        self.attempts: Counter[tuple[int, int]] = Counter()  # (bucket, draft_len) -> probes
        # The benchmark's cost sweep: a fixed draft_len, and a record of every measured step.
        self.force: int | None = None
        self.trace: list[StepRecord] | None = None

    # ---- decisions ----------------------------------------------------------------------
    def choose(self, batch: int) -> int:
        """Draft length for a step that schedules ``batch`` requests."""
        self.step += 1
        c = self._decide(batch)
        if c.probe:
            self.last_probe[(bucket(batch), c.draft_len)] = self.step
            self.attempts[(bucket(batch), c.draft_len)] += 1
        return c.draft_len

    def _decide(self, batch: int) -> Choice:
        if self.force is not None:
            return Choice(min(self.force, self.k_max), probe=False)
        b = bucket(batch)
        # A probe only measures on a step without prefill; one that got no measurement in
        # 4x the probes it needs (a stream of arrivals) is left to the periodic refreshes.
        need = self.s.adaptive_probe_samples
        unmeasured = [
            g
            for g in self.probes
            if self.costs.samples(batch, g) < need and self.attempts[(b, g)] < 4 * need
        ]
        # A new bucket probes every other step (every step before any cost is known); the
        # steps between use the nearest measured bucket's costs. Probes cycle through the
        # draft_lens rather than measure one many times running.
        if unmeasured and (self.step % 2 == 0 or self.costs.curve(batch) is None):
            return Choice(min(unmeasured, key=lambda g: self.last_probe.get((b, g), -1)), True)
        best = self.best(batch)
        if unmeasured or self.step % self.s.adaptive_explore_every:
            return Choice(best, probe=False)
        # Refresh: mostly the draft_lens either side of the best, where a better choice would
        # appear first (they need not be probe draft_lens: this is how the curve between probes
        # gets measured); every fourth time the stalest probe draft_len.
        self.explorations += 1
        near = [g for g in (best - 1, best + 1) if 1 <= g <= self.k_max]
        pool = self.probes if self.explorations % 4 == 0 or not near else near
        return Choice(min(pool, key=lambda g: self.last_probe.get((b, g), -1)), True)

    def rates(self, batch: int) -> dict[int, float]:
        """Expected tokens per second per request for each draft_len with a cost estimate."""
        tau, cost = self.acceptance.tau(), self.costs.curve(batch)
        if cost is None:
            return {}
        return {g: tau[g] / t for g in range(1, self.k_max + 1) if (t := cost(g)) > 0}

    def best(self, batch: int) -> int:
        """argmax of tau(draft_len) / T(batch, draft_len); the smallest draft_len wins a tie, K
        without any cost estimate."""
        rates = self.rates(batch)
        if not rates:
            return self.k_max
        return max(rates, key=lambda g: (rates[g], -g))

    # ---- observations -------------------------------------------------------------------
    def observe_verify(self, drafted: int, accepted: int) -> None:
        if drafted > 0:
            self.acceptance.observe(drafted, accepted)

    def observe_step(
        self,
        batch: int,
        drafted_len: int,
        drafter_s: float,
        verified_len: int,
        verify_s: float,
    ) -> None:
        """Runner times of one pure-decode step (no prefill in it)."""
        if self.trace is not None:
            self.trace.append(StepRecord(batch, drafted_len, drafter_s, verified_len, verify_s))
        if batch <= 0:
            return
        if drafted_len > 0 and drafter_s > 0:
            self.costs.add_draft(batch, drafted_len, drafter_s)
        if verified_len > 0 and verify_s > 0:
            self.costs.add_verify(batch, verified_len, verify_s)
