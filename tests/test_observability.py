"""Metrics arithmetic, settings, the stats channel and the stat logger's accounting, the
dashboard's freshness and the alert rules (promtool), without starting an engine."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from vllm_dflash.errors import DFlashConfigError
from vllm_dflash.observability import dashboard
from vllm_dflash.observability import names as n
from vllm_dflash.observability.baseline import (
    BaselineTable,
    MetricsSettings,
    RequestCounters,
    SamplePolicy,
    bucket,
    request_speedup,
)

ROOT = Path(__file__).resolve().parents[1]


# ---- settings and baseline arithmetic ---------------------------------------------------
def test_settings_from_env():
    assert MetricsSettings.from_env({}) == MetricsSettings()
    s = MetricsSettings.from_env({"VLLM_DFLASH_BASELINE_EVERY": "0", "UNRELATED": "x"})
    assert s.baseline_every == 0
    with pytest.raises(DFlashConfigError) as e:
        MetricsSettings.from_env({"VLLM_DFLASH_ACCEPTANCE_FLOOR": "0.5"})
    msg = str(e.value)
    assert "VLLM_DFLASH_ACCEPTANCE_FLOOR='0.5'" in msg and "Fix:" in msg and "default 1.5" in msg
    with pytest.raises(DFlashConfigError, match="VLLM_DFLASH_BASELINE_EVERY='often'"):
        MetricsSettings.from_env({"VLLM_DFLASH_BASELINE_EVERY": "often"})


def test_buckets():
    assert [bucket(b) for b in (0, 1, 5, 8, 9, 16, 17, 100)] == [1, 1, 5, 8, 16, 16, 32, 128]


def test_sample_policy_fills_buckets_then_refreshes_rarely():
    p = SamplePolicy(
        MetricsSettings(
            baseline_every=100, baseline_min_gap=10, baseline_samples=2, baseline_warmup=5
        )
    )
    assert not p.due(9, 0), "no decoding request, nothing to measure"
    taken = [s for s in range(1, 400) if p.due(s, 3) and (p.taken(s, 3) or True)]
    # None in the warm-up; two samples 10 steps apart fill the bucket; then one per 100.
    assert taken == [6, 16, 116, 216, 316]
    assert not p.due(320, 5) and p.due(326, 5), "a new batch size: as soon as the gap allows"
    off = SamplePolicy(MetricsSettings(baseline_every=0))
    assert not any(off.due(s, 1) for s in range(1000))


def test_baseline_table_median_and_interpolation():
    t = BaselineTable(keep=3)
    assert t.step_seconds(1) is None
    for secs in (0.010, 0.050, 0.012, 0.011):  # keeps the last 3: median 0.012
        t.add(1, secs)
    t.add(4, 0.020)
    t.add(0, 1.0)  # ignored
    assert t.medians() == {1: 0.012, 4: 0.020}
    assert t.step_seconds(1) == 0.012 and t.step_seconds(4) == 0.020
    assert t.step_seconds(2.5) == pytest.approx(0.016)
    assert t.step_seconds(64) == 0.020, "beyond the measured range: the nearest bucket"


def test_request_speedup_and_acceptance_length():
    t = BaselineTable()
    t.add(2, 0.01)  # 100 tok/s without speculation at batch 2
    # 60 tokens in 0.3 s = 200 tok/s -> 2x.
    assert request_speedup(60, 0.3, 2.0, t) == pytest.approx(2.0)
    assert request_speedup(60, 0.3, None, t) is None
    assert request_speedup(0, 0.3, 2.0, t) is None
    assert request_speedup(60, 0.3, 2.0, BaselineTable()) is None
    c = RequestCounters()
    assert c.acceptance_length() is None
    c.verify_steps, c.verify_tokens, c.batch_sum = 4, 10, 12
    assert c.acceptance_length() == 2.5 and c.mean_batch() == 3.0


# ---- the stats channel and the stat logger, with vLLM's own classes ---------------------
def test_scheduler_stats_field_survives_vllms_serialisation():
    from vllm.v1.engine import EngineCoreOutputs
    from vllm.v1.metrics import stats
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    from vllm_dflash.serving import scheduler_hooks

    scheduler_hooks._declare_stats_field(stats)
    s = stats.SchedulerStats(num_running_reqs=2)
    s.dflash = {"drafter_s": [0.001], "baseline": [[2, 0.004]], "no_verify": True}
    out = MsgpackDecoder(EngineCoreOutputs).decode(
        MsgpackEncoder().encode(EngineCoreOutputs(scheduler_stats=s))
    )
    assert out.scheduler_stats.dflash == s.dflash
    empty = MsgpackDecoder(EngineCoreOutputs).decode(
        MsgpackEncoder().encode(EngineCoreOutputs(scheduler_stats=stats.SchedulerStats()))
    )
    assert empty.scheduler_stats.dflash is None


def _logger():
    from vllm_dflash.serving.stat_logger import DFlashStatLogger

    class Cfg:  # the two fields the logger reads
        speculative_config = object()

        class model_config:  # noqa: N801
            served_model_name = "unit-test-model"

    log = DFlashStatLogger.__new__(DFlashStatLogger)
    log.start(Cfg(), engine_index=7)  # as where our proposer serves (activate.decide)
    return log


def test_stat_logger_accounts_per_request(monkeypatch):
    """Two requests decode together: two verify steps (3 and 1 tokens for request a), one
    baseline step that must not count as a verify step, then both finish."""
    from vllm.v1.engine import EngineCoreOutput, FinishReason
    from vllm.v1.metrics.stats import IterationStats, LoRARequestStates, RequestStateStats
    from vllm.v1.metrics.stats import SchedulerStats as Sched

    from vllm_dflash.serving import scheduler_hooks

    scheduler_hooks._declare_stats_field(__import__("vllm.v1.metrics.stats", fromlist=["x"]))
    log = _logger()
    reqs = {"a": RequestStateStats(), "b": RequestStateStats()}
    lora = LoRARequestStates()
    t = [0.0]

    def step(tokens: dict[str, int], sched: dict | None, prefill: bool = False):
        t[0] += 0.01
        it = IterationStats()
        for rid, k in tokens.items():
            out = EngineCoreOutput(request_id=rid, new_token_ids=list(range(k)))
            it.update_from_output(out, t[0], prefill, reqs[rid], lora, None)
        s = Sched()
        s.dflash = sched
        return it, s

    def record(it, s, finish=()):
        for rid in finish:
            it.update_from_finished_request(
                finish_reason=FinishReason.LENGTH,
                request_id=rid,
                num_prompt_tokens=5,
                max_tokens_param=None,
                req_stats=reqs[rid],
            )
        log.record(scheduler_stats=s, iteration_stats=it)

    record(*step({"a": 1, "b": 1}, None, prefill=True))
    record(*step({"a": 3, "b": 2}, {"drafter_s": [0.002], "verify_s": [0.006]}))
    record(*step({"a": 1, "b": 1}, {"no_verify": True, "baseline": [[2, 0.005]]}))
    record(*step({"a": 1, "b": 4}, None), finish=("a", "b"))

    def hist(name: str) -> tuple[float, float]:
        from prometheus_client import REGISTRY

        labels = {"model_name": "unit-test-model", "engine": "7"}
        return (
            REGISTRY.get_sample_value(name + "_sum", labels),
            REGISTRY.get_sample_value(name + "_count", labels),
        )

    # a: (3 + 1) / 2 verify steps = 2; b: (2 + 4) / 2 = 3.
    assert hist(n.REQUEST_ACCEPTANCE_LENGTH) == (5.0, 2.0)
    # Decode: a 6 tokens -> 5 after the first, b 8 -> 7, over 0.03 s; baseline 0.005 s/step.
    speed_sum, speed_count = hist(n.REQUEST_SPEEDUP)
    assert speed_count == 2
    assert speed_sum == pytest.approx((5 + 7) / 0.03 * 0.005)
    assert hist(n.DRAFTER_STEP_SECONDS) == (0.002, 1.0)
    assert hist(n.VERIFY_STEP_SECONDS) == (0.006, 1.0)


# ---- dashboard and alert rules ----------------------------------------------------------
def test_dashboard_json_is_up_to_date():
    assert dashboard.main(["--check"]) == 0, (
        "regenerate: python -m vllm_dflash.observability.dashboard"
    )


def test_dashboard_covers_the_operators_questions():
    d = dashboard.build()
    assert "null" not in dashboard.render(), "Grafana wants unset fields absent"
    titles = {p["title"] for p in d["panels"]}
    assert {
        "Acceptance length per request",
        "Acceptance by draft position",
        "Speedup per request (distribution)",
        "Median speedup",
        "Output tokens/s",
        "Drafter vs verify time",
        "Requests running / waiting",
    } <= titles
    assert {v["name"] for v in d["templating"]["list"]} == {"datasource", "model_name", "instance"}
    exprs = [t["expr"] for p in d["panels"] for t in p["targets"]]
    assert sorted(exprs) == sorted(e for _, e in dashboard.queries())
    for e in exprs:  # every selector is filtered by both variables
        assert e.count("{") == e.count('model_name=~"$model_name", instance=~"$instance"}'), e


def test_grafana_provisioning_files():
    ds = yaml.safe_load((ROOT / "grafana/provisioning/datasources/prometheus.yaml").read_text())
    assert ds["datasources"][0]["type"] == "prometheus"
    prov = yaml.safe_load((ROOT / "grafana/provisioning/dashboards/vllm-dflash.yaml").read_text())
    assert prov["providers"][0]["type"] == "file"


def _promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail("promtool is not on PATH. Fix: `make test`, or `make tools` (.tools/bin)")
    return path


def test_alert_rules_are_valid():
    out = subprocess.run(
        [_promtool(), "check", "rules", str(ROOT / "deploy/prometheus/dflash-alerts.yaml")],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "5 rules found" in out.stdout + out.stderr


def test_alert_rules_unit_tests():
    out = subprocess.run(
        [_promtool(), "test", "rules", "dflash-alerts.test.yaml"],
        cwd=ROOT / "deploy/prometheus/tests",
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_alert_rule_tests_have_power(tmp_path):
    """The same promtool tests against rules with a broken floor comparison must fail."""
    rules = (ROOT / "deploy/prometheus/dflash-alerts.yaml").read_text()
    broken = rules.replace("< on (model_name, instance)", "> on (model_name, instance)")
    assert broken != rules
    (tmp_path / "dflash-alerts.yaml").write_text(broken)
    tests = (ROOT / "deploy/prometheus/tests/dflash-alerts.test.yaml").read_text()
    (tmp_path / "t").mkdir()
    (tmp_path / "t/dflash-alerts.test.yaml").write_text(tests)
    out = subprocess.run(
        [_promtool(), "test", "rules", "dflash-alerts.test.yaml"],
        cwd=tmp_path / "t",
        capture_output=True,
        text=True,
    )
    assert out.returncode != 0 and "DFlashAcceptanceLengthLow" in out.stdout + out.stderr
