"""The backend comparison's arithmetic: best-of tok/s, paired-median ratios, output check."""

from __future__ import annotations

import json

import pytest

from vllm_dflash.bench.compare_backends import compare, markdown, percentiles_ms
from vllm_dflash.bench.records import SpecCounters, TimedPass


def _pass(seconds: float, outputs=((1, 2, 3, 4),), drafts=2, accepted=3, **more) -> TimedPass:
    spec = SpecCounters(drafts=drafts, draft_tokens=7 * drafts, accepted=accepted)
    run = TimedPass(1, seconds, [list(o) for o in outputs], spec, **more)
    # What the engine process sends is what the comparison reads.
    assert TimedPass.from_json(json.loads(run.to_json())) == run
    return run


def test_paired_ratios_and_flags():
    passes = {
        # round 2 is a slow spell for everyone: the paired ratio ignores it
        ("dflash", 1): [
            _pass(1.0, drafter_s=[0.001, 0.003]),
            _pass(4.0, drafter_s=[0.002]),
            _pass(1.0),
        ],
        ("builtin", 1): [_pass(2.0), _pass(8.0), _pass(2.0)],
        ("none", 1): [_pass(4.0, drafts=0), _pass(16.0, drafts=0), _pass(4.0, drafts=0)],
    }
    rows = {r.backend: r for r in compare(passes, [1])}
    assert rows["dflash"].tokens_per_s == pytest.approx(4.0)  # best pass: 4 tokens in 1 s
    assert rows["dflash"].ratio_vs_builtin == pytest.approx(2.0)
    assert rows["dflash"].speedup_vs_none == pytest.approx(4.0)
    assert rows["dflash"].acceptance_length == pytest.approx(2.5)
    assert rows["dflash"].draft_tokens_per_step == pytest.approx(7.0)
    assert rows["none"].draft_tokens_per_step is None
    assert rows["dflash"].drafter_ms == pytest.approx(2.0)  # mean over every drafting step
    assert rows["builtin"].drafter_ms is None  # its passes carried no records
    assert rows["none"].acceptance_length is None and rows["none"].ratio_vs_builtin is None
    assert all(r.matches_none for r in rows.values())
    table = markdown(list(rows.values()))
    assert "| dflash | 1 | 4.0 | 7.00 | 2.500 | 4.00× | 2.000 | 2.00 | – | – | yes |" in table


def test_different_output_is_flagged():
    passes = {
        ("dflash", 1): [_pass(1.0, outputs=((1, 2, 3, 5),))],
        ("builtin", 1): [_pass(1.0)],
        ("none", 1): [_pass(1.0, drafts=0)],
    }
    rows = {r.backend: r for r in compare(passes, [1])}
    assert not rows["dflash"].matches_none and rows["builtin"].matches_none
    assert "| NO |" in markdown(list(rows.values()))


def test_latency_percentiles_pool_every_pass():
    ttft = [0.010, 0.020, 0.030, 0.040, 0.050, 0.060, 0.070, 0.080, 0.090, 0.100]
    p1 = _pass(1.0, ttft=ttft[:5], tpot=[0.004])
    p2 = _pass(1.0, ttft=ttft[5:], tpot=[0.006])
    passes = {("dflash", 1): [p1, p2], ("none", 1): [_pass(2.0, drafts=0)] * 2}
    rows = {r.backend: r for r in compare(passes, [1], ("dflash", "none"))}
    assert rows["dflash"].ttft_ms == pytest.approx((60.0, 100.0, 100.0))
    assert rows["dflash"].tpot_ms == pytest.approx((6.0, 6.0, 6.0))
    assert rows["none"].ttft_ms is None
    assert "| 60.0 / 100.0 | 6.0 / 6.0 |" in markdown(list(rows.values()))
    assert percentiles_ms([]) is None
