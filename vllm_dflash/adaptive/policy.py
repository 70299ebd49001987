"""Who drafts, and how many drafts each verifies: the draft-length policy our plugin serves
by default (``VLLM_DFLASH_DRAFT_POLICY=auto``).

Each engine step, for the B requests that decode, the policy picks a step length g
(1..K, K = ``num_speculative_tokens``) and a set S of requests that draft; every other
request has draft length 0 for that step and decodes plainly. It maximises the tokens per
second the step is expected to commit,

    (B + sum over r in S of (tau_r(g) - 1))
    / (T_plain(B) + [S not empty] * c_fixed(B) + |S| * (c_row(B) + g * c_tok(B)))

* ``tau_r(g)``: the tokens request r commits per step at length g, from its *own*
  per-position acceptance (a memory of ``policy_half_life`` verifies), shrunk towards
  the engine-wide estimate (``ENGINE_HALF_LIFE`` verifies, and as many engine steps, so
  that where few requests verify, the probes' recent outcomes are the estimate) while
  the request has little history. So one request whose drafts keep missing stops drafting
  while the others go on.
* ``T_plain``, ``c_fixed``, ``c_row``, ``c_tok``: measured from every decode step: the
  model runner's time in the drafter (``serving/step_timing.py``) and the rest of the
  engine loop (target forward, verification, scheduling, vLLM's bookkeeping, output
  processing; ``serving/draft_plan.observe_costs``). Per batch-size bucket: the drafter's
  time when nobody drafts (the context K/V write alone), the rest of a step that verifies
  nothing (a plain decode step), and what verifying adds to the rest, a line in the
  verified drafts. Over every batch size: what drafting adds to the drafter's time, a
  line in the drafting requests. Each line has a fixed part, paid once by a step in which
  anybody drafts (the drafter forward's own; the spec-decode inputs and the rejection
  sampler), and a part per request or draft. On a GPU the line is the local slope at the
  counts it serves. A bucket without
  measurements yet runs plain probe steps (S empty) on every other step until it has
  them, and refreshes one every ``policy_refresh_every`` steps.

For each g, the best S of each size is the requests with the largest tau_r(g) - 1, so the
policy scans those prefixes, the fixed part paid once by all of them. A request outside S
is *probed*: after ``policy_first_probe`` steps without drafting it verifies one draft,
and the wait doubles after each probe that did not put it back into S, up to
``policy_max_probe``. One draft is the cheapest test that can say yes (a miss at the first
position hides the others anyway), and a request probes only on engine steps that are a
multiple of its wait, so that the requests due share one drafter forward instead of
paying one each. A probe that
lands clears the request's own history: the misses that stopped it are no longer what it
gets. Its wait falls back to ``policy_first_probe`` only when it is back in S: where
drafts land too rarely to pay, probes land now and then, and must not keep it probing
often. A new request's first wait is the engine's, due at its next multiple: it doubles
with every probe and falls back to ``policy_first_probe`` when a request is back in S,
so where no drafts land at all, new requests do not each pay for the same lesson, and
requests shorter than the wait still probe.

Requests that sample with a ``seed`` follow a rule of their own history only (they draft
while their own expected accepted drafts per step stay at or above
``policy_seeded_min_accepted``, and probe on the same schedule): the number of drafts a
seeded request verifies, and so the random numbers its rejection sampling draws, never
depends on what else is in the batch, and the same request repeats its tokens in any
batch (the metrics' baseline steps wait while a seeded request runs).

The drafter always drafts its full block for a drafting request (a DFlash block's
positions attend to each other, so a shorter block would be a different distribution);
the step length only limits how many of those drafts are verified. The context K/V of a
request that does not draft waits, at most until its cache block fills, and is written in
one projection when it drafts again (``serving/deferred_context.py``).

With a *shared drafter* (runner V2, whose captured block forward drafts for every request
of the batch or for none), the drafter's cost is the batch's, paid once when any request
drafts, and every free request gets the same length g, 0 included: a request's own 0 would
save only its verification, and equal lengths keep the batch in the uniform decode shape
V2 captures its graphs for. Probes are then the engine's: the whole batch verifies one
draft, and the wait doubles once per probe step that does not bring drafting back.

Pure Python: it runs, and is tested, without vLLM (``serving/draft_plan.py`` wires it into
vLLM's scheduler).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from pydantic import Field

from vllm_dflash.adaptive.controller import AcceptanceEstimate, _Fit
from vllm_dflash.env_settings import EnvSettings
from vllm_dflash.observability.baseline import bucket


class PolicySettings(EnvSettings):
    """Read from ``VLLM_DFLASH_<FIELD>`` in every vLLM process."""

    draft_policy: Literal["auto", "fixed"] = Field(
        "auto",
        description='"auto" (each request drafts only where it pays) or "fixed" (every '
        "request verifies num_speculative_tokens drafts every step)",
    )
    policy_first_probe: int = Field(
        4,
        ge=1,
        description="the shortest wait, in steps, before a probe (where probes land; the "
        "wait doubles with each one that misses)",
    )
    policy_max_probe: int = Field(
        64, ge=1, description="the longest wait, in steps, between two probes of a request"
    )
    policy_half_life: int = Field(
        24, ge=1, description="verifies after which a request's own acceptance weighs 1/2"
    )
    policy_refresh_every: int = Field(
        64, ge=2, description="steps between plain steps that refresh the measured costs"
    )
    policy_seeded_min_accepted: float = Field(
        1.0, ge=0.0, description="accepted drafts per step a seeded request needs to draft"
    )


# Pseudo-verifies of the engine-wide acceptance that a request's own counts start from.
PRIOR_WEIGHT = 2.0
PROBE_DRAFTS = 1  # drafts a probe verifies
# Verifies after which an engine-wide observation weighs 1/2. Short: the engine-wide
# acceptance is a new request's prior, and where drafts stop landing few verifies happen,
# so a long memory would keep new requests drafting on the old traffic's acceptance.
ENGINE_HALF_LIFE = 64
PLAIN_SAMPLES = 2  # plain-step measurements a bucket needs before it trusts its costs
# The variance of the counts above which a cost line tells its fixed part from its slope:
# one step in eight at another count of 1 (1 and 2 can never spread further than 0.25).
SPREAD = 0.1


@dataclass
class RequestState:
    """One request's acceptance by draft position, and where it is in its probe schedule."""

    seeded: bool
    trials: list[float]
    hits: list[float]
    idle: int = 0  # consecutive steps without drafting
    wait: int = 0  # idle steps before the next probe
    probing: bool = False  # its pending drafts are a probe's

    def observe(self, drafted: int, accepted: int, keep: float) -> None:
        for k in range(min(drafted, accepted + 1, len(self.trials))):
            self.trials[k] = self.trials[k] * keep + 1.0
            self.hits[k] = self.hits[k] * keep + (1.0 if k < accepted else 0.0)

    def tau(self, prior: list[float], weight: float) -> list[float]:
        """tau(g) for g = 0..K: 1 + sum over k <= g of a_1 * ... * a_k, with a_k its own
        rate shrunk towards ``prior[k]`` by ``weight`` pseudo-trials."""
        out, c = [1.0], 1.0
        for t, h, p in zip(self.trials, self.hits, prior, strict=True):
            c *= (h + weight * p) / (t + weight)
            out.append(out[-1] + c)
        return out


@dataclass
class _Line:
    """What a step adds, in seconds, against a count (drafting requests, verified drafts):
    ``fixed`` (paid once when the count is above 0) + ``per`` * count, by exponentially
    weighted least squares. Counts that stay at about one value cannot tell the two apart:
    the last fixed part that could be told apart is kept, none at first, and ``per`` fits
    the rest. Without the fixed part, a drafter forward's fixed cost measured while few
    requests draft would be charged to each of them, and the drafting set would stay small."""

    fit: _Fit = field(default_factory=_Fit)
    fixed: float = 0.0
    per: float = 0.0

    @property
    def samples(self) -> int:
        return self.fit.samples

    def add(self, count: int, seconds: float, keep: float) -> None:
        f = self.fit
        f.add(count, seconds, keep)
        mx, my = f.b / f.w, f.t / f.w
        var = f.bb / f.w - mx * mx
        if var >= SPREAD:
            per = (f.bt / f.w - mx * my) / var
            if per < 0.0:  # never cheaper with more: all fixed
                self.fixed, self.per = my, 0.0
            elif my - per * mx < 0.0:  # no negative fixed part: a line through 0
                self.fixed, self.per = 0.0, f.bt / f.bb
            else:
                self.fixed, self.per = my - per * mx, per
        else:
            self.fixed = min(self.fixed, my)
            self.per = (my - self.fixed) / mx


@dataclass
class BucketCosts:
    """Step costs at one batch-size bucket (seconds): a plain step's against batch size,
    and what verifying adds against the verified drafts. The latter is per bucket: the
    target computes the drafts beside the batch's own tokens, and the cost of a token
    more grows with the tokens already in the forward (on a CPU, where small forwards
    are bound by reading the weights)."""

    plain_draft: _Fit = field(default_factory=_Fit)
    plain_verify: _Fit = field(default_factory=_Fit)
    verifying: _Line = field(default_factory=_Line)

    def complete(self) -> bool:
        return (
            min(self.plain_draft.samples, self.plain_verify.samples) >= PLAIN_SAMPLES
            and self.verifying.samples > 0
        )


@dataclass(frozen=True)
class Costs:
    plain: float  # a step in which nobody drafts or verifies
    fixed: float  # added once by a step in which anybody drafts (and verifies)
    row: float  # added by each drafting request
    token: float  # added by each verified draft


@dataclass
class Decision:
    """One step's plan: draft length per request (0: decodes plainly, drafts nothing)."""

    lengths: dict[str, int]
    draft_len: int  # the step length of the cost-chosen requests
    plain_probe: bool  # a step that measures the plain cost


class DraftPolicy:
    def __init__(
        self, k_max: int, settings: PolicySettings | None = None, shared_drafter: bool = False
    ) -> None:
        """``shared_drafter``: the drafter drafts for the whole batch whenever any request
        drafts (runner V2's captured block forward); the requests then share one length."""
        if k_max < 1:
            raise ValueError(f"k_max = {k_max}: need at least one draft token")
        self.k = k_max
        self.s = settings or PolicySettings()
        self.shared_drafter = shared_drafter
        self.idle = 0  # shared drafter: consecutive steps in which no free request drafted
        self.keep = 0.5 ** (1.0 / self.s.policy_half_life)
        self.engine = AcceptanceEstimate(k_max, half_life=ENGINE_HALF_LIFE)
        self.requests: dict[str, RequestState] = {}
        self.costs: dict[int, BucketCosts] = {}
        # What drafting adds to the drafter's time, against the drafting requests: one
        # line for every batch size, since the drafter computes the drafting requests'
        # blocks only, and counts differ more across batch sizes than within one.
        self.drafting = _Line()
        self.step = 0
        self.plain_attempts: dict[int, int] = {}
        self.probe_wait = self.s.policy_first_probe  # a new request's first wait

    # ---- decisions ----------------------------------------------------------------------
    def plan(self, batch: list[tuple[str, bool]]) -> Decision:
        """Draft lengths for the requests ``batch`` [(request id, seeded)] that decode in
        this step; they draft now and verify these lengths in the next step."""
        self.step += 1
        # Where drafting stopped, probes are the only verifies: forgetting per verify
        # alone would keep the traffic before as their prior long after it changed.
        self.engine.forget()
        states = {rid: self._state(rid, seeded) for rid, seeded in batch}
        lengths = {rid: self._seeded_length(st) for rid, st in states.items() if st.seeded}
        free = [rid for rid, st in states.items() if not st.seeded]
        b = len(batch)
        costs = self.costs_at(b)
        if self.shared_drafter:
            return self._plan_shared(states, lengths, free, costs, b)
        draft_len, chosen, plain_probe = self.k, list(free), False
        if self._plain_probe_due(b, costs):
            draft_len, chosen, plain_probe = 0, [], True
        elif costs is not None:
            draft_len, chosen = self._choose(free, lengths, states, costs, b)
        for rid in free:
            lengths[rid] = draft_len if rid in chosen else 0
        for rid, st in states.items():
            if (
                not st.seeded
                and not plain_probe
                and lengths[rid] == 0
                and st.idle >= st.wait
                and self.step % st.wait == 0  # due probes fall on the same steps
            ):
                lengths[rid] = PROBE_DRAFTS  # a probe: does drafting pay again?
                st.wait = min(2 * st.wait, self.s.policy_max_probe)
                st.probing = True
            elif not st.seeded and rid in chosen:
                if st.idle:  # back in S: drafting pays again, new requests probe soon
                    self.probe_wait = self.s.policy_first_probe
                st.wait = self.s.policy_first_probe
                st.probing = False
            st.idle = 0 if lengths[rid] else st.idle + 1
        return Decision(lengths, draft_len, plain_probe)

    def _plan_shared(
        self,
        states: dict[str, RequestState],
        lengths: dict[str, int],
        free: list[str],
        costs: Costs | None,
        b: int,
    ) -> Decision:
        """One length for every free request: with a shared drafter a request's 0 saves
        only its verification, and equal lengths keep the batch in the uniform decode shape
        that runner V2 captures CUDA graphs for. Probes are the engine's: every free
        request verifies one draft on the same step, and the wait doubles once per probe
        that does not bring drafting back."""
        g, plain_probe = self.k, False
        if self._plain_probe_due(b, costs):
            g, plain_probe = 0, True
        elif costs is not None:
            g = self._choose_shared(free, lengths, states, costs, b)
        probe = (
            g == 0
            and not plain_probe
            and bool(free)
            and self.idle >= self.probe_wait
            and self.step % self.probe_wait == 0
        )
        if probe:
            g = PROBE_DRAFTS
            self.probe_wait = min(2 * self.probe_wait, self.s.policy_max_probe)
        elif g:
            self.probe_wait = self.s.policy_first_probe
        for rid in free:
            lengths[rid] = g
            states[rid].probing = probe
        self.idle = 0 if g else self.idle + 1
        return Decision(lengths, g, plain_probe)

    def _choose_shared(
        self,
        free: list[str],
        fixed: dict[str, int],
        states: dict[str, RequestState],
        costs: Costs,
        b: int,
    ) -> int:
        """The free requests' common length g (0 included) that maximises the expected
        commit rate, the drafter's whole-batch cost paid once when any request drafts."""
        prior = self.engine.conditional()
        taus = [states[rid].tau(prior, PRIOR_WEIGHT) for rid in free]
        base_n, base_drafts = float(b), 0
        for rid, g in fixed.items():  # seeded requests: their lengths are given
            if g:
                base_n += states[rid].tau(prior, PRIOR_WEIGHT)[g] - 1.0
                base_drafts += g

        def rate(g: int) -> float:
            drafts = base_drafts + g * len(free)
            t = (
                costs.plain
                + drafts * costs.token
                + (costs.fixed + b * costs.row if drafts else 0.0)
            )
            return (base_n + sum(tau[g] - 1.0 for tau in taus)) / t

        best_g, best_rate = 0, rate(0)
        for g in range(1, self.k + 1):
            if (r := rate(g)) > best_rate * (1.0 + 1e-9):
                best_g, best_rate = g, r
        return best_g

    def _state(self, rid: str, seeded: bool) -> RequestState:
        st = self.requests.get(rid)
        if st is None:
            # A seeded request's schedule is its own. The others start at the engine's
            # wait, and are due at its next multiple: a request shorter than the wait
            # would otherwise never probe, and short requests could never find out that
            # drafts land again.
            wait = self.s.policy_first_probe if seeded else self.probe_wait
            st = self.requests[rid] = RequestState(
                seeded, [0.0] * self.k, [0.0] * self.k, idle=0 if seeded else wait, wait=wait
            )
        return st

    def _seeded_length(self, st: RequestState) -> int:
        """A function of the request's own history only (see the module docstring)."""
        if st.trials[0] == 0.0:
            return self.k  # no history yet: draft
        accepted = st.tau([0.5] * self.k, PRIOR_WEIGHT)[self.k] - 1.0
        if accepted >= self.s.policy_seeded_min_accepted:
            st.wait = self.s.policy_first_probe
            return self.k
        if st.idle >= st.wait:
            st.wait = min(2 * st.wait, self.s.policy_max_probe)
            return self.k
        return 0

    def _plain_probe_due(self, b: int, costs: Costs | None) -> bool:
        own = self.costs.get(bucket(b))
        samples = 0 if own is None else min(own.plain_draft.samples, own.plain_verify.samples)
        if samples < PLAIN_SAMPLES:
            tries = self.plain_attempts.get(bucket(b), 0)
            if tries < 4 * PLAIN_SAMPLES and (self.step % 2 == 0 or costs is None):
                self.plain_attempts[bucket(b)] = tries + 1
                return True
            return False
        # Off the multiples of the probe waits, so a plain step never takes a probe's turn.
        return self.step % self.s.policy_refresh_every == 1

    def _choose(
        self,
        free: list[str],
        fixed: dict[str, int],
        states: dict[str, RequestState],
        costs: Costs,
        b: int,
    ) -> tuple[int, list[str]]:
        """The step length and drafting set that maximise the expected commit rate: for
        each length, the best set of each size is the requests that gain most, and the
        drafter's fixed cost is paid once (already, where a seeded request drafts)."""
        prior = self.engine.conditional()
        taus = {rid: states[rid].tau(prior, PRIOR_WEIGHT) for rid in free}
        base_n, base_t, prepaid = float(b), costs.plain, False
        for rid, g in fixed.items():  # seeded requests: their lengths are given
            if g:
                base_n += states[rid].tau(prior, PRIOR_WEIGHT)[g] - 1.0
                base_t += costs.row + g * costs.token
                prepaid = True
        if prepaid:
            base_t += costs.fixed
        best_rate, best_g, best_n = base_n / base_t, 0, 0
        drafting_t = base_t + (0.0 if prepaid else costs.fixed)  # before any row's cost
        # Nothing can beat drafting nobody if every gain there is, at the least a drafting
        # step can cost, does not (tau grows with g): the common step where drafts miss.
        most = base_n + sum(tau[self.k] - 1.0 for tau in taus.values())
        if most / (drafting_t + costs.row + costs.token) <= best_rate * (1.0 + 1e-9):
            return self.k, []
        for g in range(1, self.k + 1):
            cost = costs.row + g * costs.token
            n, t = base_n, drafting_t
            gains = sorted((tau[g] - 1.0 for tau in taus.values()), reverse=True)
            for m, gain in enumerate(gains, 1):
                n, t = n + gain, t + cost
                if n / t > best_rate * (1.0 + 1e-9):
                    best_rate, best_g, best_n = n / t, g, m
        if best_g == 0:
            return self.k, []
        ranked = sorted(free, key=lambda rid: taus[rid][best_g], reverse=True)
        return best_g, ranked[:best_n]

    def costs_at(self, b: int) -> Costs | None:
        """Costs at batch size ``b``: its own bucket's once complete, else the nearest
        complete bucket's (in log batch size), else None."""
        own = bucket(b)
        done = [k for k, c in self.costs.items() if c.complete()]
        if not done or not self.drafting.samples:
            return None
        pick = own if own in done else min(done, key=lambda k: (abs(math.log(k / own)), k))
        c = self.costs[pick]
        plain = c.plain_draft.at(b) + c.plain_verify.at(b)
        d, v = self.drafting, c.verifying
        return Costs(plain, d.fixed + v.fixed, d.per, v.per)

    # ---- observations -------------------------------------------------------------------
    def observe_verify(self, rid: str, drafted: int, accepted: int) -> None:
        """Request ``rid`` verified ``drafted`` drafts and ``accepted`` of them (a prefix)."""
        if drafted <= 0:
            return
        self.engine.observe(drafted, accepted)
        st = self.requests.get(rid)
        if st is None:
            return
        if st.probing and accepted:
            # A probe landed: the misses that stopped the request are no longer what it
            # gets, so it starts afresh from the engine-wide estimate. Its wait stays
            # doubled until that puts it back into S (``plan``): where drafts land too
            # rarely to pay, probes that land now and then must not keep it probing often.
            st.trials, st.hits = [0.0] * self.k, [0.0] * self.k
        if st.probing and not self.shared_drafter:  # shared: doubled once per probe step
            self.probe_wait = min(2 * self.probe_wait, self.s.policy_max_probe)
        st.probing = False
        st.observe(drafted, accepted, self.keep)

    def observe_step(
        self, batch: int, drafting: int, drafter_s: float, verified: int, verify_s: float
    ) -> None:
        """Runner times of one decode step: ``drafting`` requests drafted (the drafter's
        ``drafter_s``), ``verified`` drafts were verified (the rest, ``verify_s``)."""
        if batch <= 0:
            return
        c = self.costs.setdefault(bucket(batch), BucketCosts())
        keep = 0.97
        if drafting == 0:
            c.plain_draft.add(batch, drafter_s, keep)
        elif c.plain_draft.samples:
            self.drafting.add(drafting, max(drafter_s - c.plain_draft.at(batch), 0.0), keep)
        if verified == 0:
            c.plain_verify.add(batch, verify_s, keep)
        elif c.plain_verify.samples:
            c.verifying.add(verified, max(verify_s - c.plain_verify.at(batch), 0.0), keep)

    def finished(self, request_ids: set[str]) -> None:
        for rid in request_ids:
            self.requests.pop(rid, None)
