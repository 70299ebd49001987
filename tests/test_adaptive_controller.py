"""The adaptive draft-length controller, without vLLM: its estimates converge to the truth
of a simulated engine, and it then picks the draft_len that maximises tokens per second."""

from __future__ import annotations

import random

import pytest

from vllm_dflash.adaptive.controller import (
    AcceptanceEstimate,
    AdaptiveSettings,
    DraftLenController,
    StepCosts,
    probe_draft_lens,
)
from vllm_dflash.bench.analytic import expected_acceptance_length
from vllm_dflash.errors import DFlashConfigError

TRUE_A = [0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1]  # conditional acceptance per position


def _accepted(rng: random.Random, draft_len: int, a=TRUE_A) -> int:
    n = 0
    while n < draft_len and rng.random() < a[n]:
        n += 1
    return n


def test_probe_draft_lens_cover_one_to_k():
    assert probe_draft_lens(15) == [1, 2, 4, 8, 15]
    assert probe_draft_lens(16) == [1, 2, 4, 8, 16]
    assert probe_draft_lens(1) == [1]
    assert probe_draft_lens(3) == [1, 2, 3]


def test_acceptance_estimate_converges_to_the_truth():
    rng = random.Random(0)
    est = AcceptanceEstimate(len(TRUE_A), half_life=100_000)
    for _ in range(30_000):
        est.observe(len(TRUE_A), _accepted(rng, len(TRUE_A)))
    for got, want, trials in zip(est.conditional(), TRUE_A, est.trials, strict=True):
        if trials > 1000:  # the late positions are rarely reached
            assert got == pytest.approx(want, abs=0.03)
    for g in range(len(TRUE_A) + 1):
        want = expected_acceptance_length(conditional=TRUE_A[:g]) if g else 1.0
        assert est.tau()[g] == pytest.approx(want, rel=0.03)


def test_untried_positions_inherit_the_last_tried_one():
    rng = random.Random(1)
    est = AcceptanceEstimate(8, half_life=100_000)
    for _ in range(5_000):
        est.observe(2, _accepted(rng, 2))  # only positions 1 and 2 are ever drafted
    a = est.conditional()
    assert a[0] == pytest.approx(0.8, abs=0.03) and a[1] == pytest.approx(0.7, abs=0.03)
    assert a[2:] == pytest.approx([a[1]] * 6)


def test_acceptance_follows_a_change_within_its_half_life():
    rng = random.Random(2)
    est = AcceptanceEstimate(4, half_life=500)
    for _ in range(5_000):
        est.observe(4, _accepted(rng, 4, [0.9] * 4))
    for _ in range(5_000):
        est.observe(4, _accepted(rng, 4, [0.2] * 4))
    assert est.conditional()[0] == pytest.approx(0.2, abs=0.05)


def test_costs_interpolate_in_draft_len_and_borrow_the_nearest_complete_bucket():
    costs = StepCosts([1, 4])
    for g, secs in ((1, 1.0), (4, 4.0)):
        costs.add_draft(4, g, secs)
        costs.add_verify(4, g, 10 * secs)
    assert costs.seconds(4, 2) == pytest.approx(2.0 + 20.0)  # linear between 1 and 4
    assert costs.seconds(4, 8) == pytest.approx(4.0 + 40.0)  # flat past the last one
    assert costs.samples(4, 1) == 1 and costs.samples(4, 2) == 0
    assert costs.seconds(32, 1) == pytest.approx(11.0)  # bucket 32 borrows bucket 4
    costs.add_draft(32, 1, 5.0)
    costs.add_verify(32, 1, 50.0)
    assert costs.seconds(32, 1) == pytest.approx(11.0)  # 32 lacks draft_len 4: still borrows
    costs.add_draft(32, 4, 6.0)
    costs.add_verify(32, 4, 60.0)
    assert costs.seconds(32, 1) == pytest.approx(55.0)
    assert costs.seconds(3, 1) == pytest.approx(11.0)  # nearest (in log batch) is 4


def test_costs_follow_batch_size_within_a_bucket():
    """Bucket 16 holds batches 9..16; a cost measured at 9 must not pass for one at 16."""
    costs = StepCosts([1])
    for batch in (9, 16, 12, 16, 9):
        costs.add_draft(batch, 1, 0.1 * batch)
        costs.add_verify(batch, 1, 1.0 * batch)
    assert costs.seconds(16, 1) == pytest.approx(17.6, rel=0.01)
    assert costs.seconds(10, 1) == pytest.approx(11.0, rel=0.01)


def _true_rate(batch: int, draft_len: int, cost) -> float:
    tau = expected_acceptance_length(conditional=TRUE_A[:draft_len])
    d, v = cost(batch, draft_len)
    return tau / (d + v)


def _simulate(cost, batches, steps=600, seed=0):
    """A simulated engine: noisy step costs ``cost(b, g) -> (D, V)`` and Bernoulli
    acceptance; returns the controller and the draft_lens it chose after warm-up, per batch."""
    rng = random.Random(seed)
    ctl = DraftLenController(len(TRUE_A))
    chosen: dict[int, list[int]] = {}
    for batch in batches:
        prev = None
        for step in range(steps):
            g = ctl.choose(batch)
            d, _ = cost(batch, g)
            if prev is not None:
                for _ in range(batch):
                    ctl.observe_verify(prev, _accepted(rng, prev))
            v = cost(batch, prev)[1] if prev else 0.0
            noise = 1 + 0.1 * (rng.random() - 0.5)
            ctl.observe_step(batch, g, d * noise, prev or 0, v * noise)
            prev = g
            if step >= steps // 2:
                chosen.setdefault(batch, []).append(g)
    return ctl, chosen


def _best(batch, cost):
    return max(range(1, len(TRUE_A) + 1), key=lambda g: _true_rate(batch, g, cost))


def gpu_like(b, g):
    """Flat until the device saturates at 64 tokens, linear after."""
    n = b * (1 + g)
    return 0.1 + 0.001 * b * (1 + g), 1.0 + 0.02 * max(0, n - 64)


def cpu_like(b, g):
    """Every token costs (the CPU test machine)."""
    return 0.2 + 0.05 * b * (1 + g), 0.3 + 0.1 * b * (1 + g)


@pytest.mark.parametrize("cost", [gpu_like, cpu_like])
def test_controller_picks_the_best_draft_len_per_batch(cost):
    batches = [1, 4, 16, 32]
    ctl, chosen = _simulate(cost, batches)
    for b in batches:
        top = _true_rate(b, _best(b, cost), cost)
        # Its choice is as good as the best (draft_lens whose rates differ by less than the
        # noise may swap), and probes cost little on average.
        assert _true_rate(b, ctl.best(b), cost) > 0.97 * top, (b, ctl.best(b), _best(b, cost))
        mean = sum(_true_rate(b, g, cost) for g in chosen[b]) / len(chosen[b])
        assert mean > 0.93 * top, (b, chosen[b])
    if cost is gpu_like:  # the load effect: long drafts at batch 1, short at 32
        assert _best(1, cost) >= 6 and _best(32, cost) <= 2


def test_probes_are_rare_once_every_probe_draft_len_is_measured():
    ctl, chosen = _simulate(cpu_like, [4], steps=800)
    picks = chosen[4]
    off_best = sum(1 for g in picks if g != ctl.best(4))
    assert off_best <= len(picks) / ctl.s.adaptive_explore_every + 2


def test_forced_draft_len_is_used_as_is():
    ctl = DraftLenController(15)
    ctl.force = 7
    assert {ctl.choose(b) for b in (1, 8, 64)} == {7}
    ctl.force = 40
    assert ctl.choose(1) == 15


def test_settings_errors_name_the_variable():
    assert AdaptiveSettings.from_env({}).adaptive is False
    assert AdaptiveSettings.from_env({"VLLM_DFLASH_ADAPTIVE": "1"}).adaptive is True
    with pytest.raises(DFlashConfigError, match="VLLM_DFLASH_ADAPTIVE='maybe'.*Fix"):
        AdaptiveSettings.from_env({"VLLM_DFLASH_ADAPTIVE": "maybe"})
    with pytest.raises(DFlashConfigError, match="VLLM_DFLASH_ADAPTIVE_EXPLORE_EVERY"):
        AdaptiveSettings.from_env({"VLLM_DFLASH_ADAPTIVE_EXPLORE_EVERY": "1"})


def test_configure_adds_vllms_dynamic_schedule_only_when_on(monkeypatch):
    from vllm_dflash.serving.adaptive_draft_len import SCHEDULE_KEY, configure

    spec = {"method": "dflash", "model": "d", "num_speculative_tokens": 15}
    monkeypatch.delenv("VLLM_DFLASH_ADAPTIVE", raising=False)
    assert configure(spec, 15) == spec
    monkeypatch.setenv("VLLM_DFLASH_ADAPTIVE", "1")
    on = configure(spec, 15)
    assert {k: v for k, v in on.items() if k != SCHEDULE_KEY} == spec
    # vLLM's own reading of the schedule: every length 1..K occurs (runner V2 captures a
    # decode CUDA graph per length it can return), K for every batch size from K on.
    from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup

    dense = build_dynamic_sd_schedule_lookup(on[SCHEDULE_KEY], 256, 15)
    assert set(dense[1:]) == set(range(1, 16)) and set(dense[15:]) == {15}
    with pytest.raises(DFlashConfigError, match=f"{SCHEDULE_KEY} and VLLM_DFLASH_ADAPTIVE=1"):
        configure({**spec, SCHEDULE_KEY: [[1, 8, 3]]}, 15)


def test_probing_stops_when_no_step_can_measure_it():
    """Under a stream of arrivals every step may carry a prefill, which is never
    measured; the controller then gives up probing instead of cycling draft_len forever."""
    ctl = DraftLenController(15)
    picks = [ctl.choose(8) for _ in range(400)]
    late = picks[200:]
    assert late.count(15) / len(late) > 0.9  # K, the choice without any cost estimate
