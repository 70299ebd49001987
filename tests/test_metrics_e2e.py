"""Our metrics end to end: a real Prometheus scrapes two real ``vllm serve`` processes
(API server and engine in separate processes) serving the embedded default with DFlash,
one with our proposer and one with vLLM's built-in (``VLLM_DFLASH_BACKEND=builtin``).

After a bounded set of requests, every PromQL query of the Grafana dashboard and its
template variables must return data, the alert rules must load in Prometheus, and the
acceptance-length histogram's mean must equal the mean of the requests' own acceptance
lengths, which vLLM reports in each response (``--per-request-spec-decode-metrics``), to 5 %.
The built-in server, where our plugin leaves vLLM as it was, exports vLLM's own
speculative-decoding series and none of ours.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path

import pytest

from vllm_dflash import assets
from vllm_dflash.bench.server import free_port, serve
from vllm_dflash.observability import dashboard
from vllm_dflash.observability import names as n

pytestmark = [pytest.mark.engine, pytest.mark.xdist_group("metrics_e2e")]

RULES = Path(__file__).resolve().parents[1] / "deploy" / "prometheus" / "dflash-alerts.yaml"
NUM_PROMPTS = 12
MAX_TOKENS = 128  # long enough that the last, truncated step weighs little
WAIT_S = 120


def _prometheus_bin() -> str:
    path = shutil.which("prometheus")
    if path is None:
        pytest.fail(
            "the prometheus server is not on PATH. Fix: run the tests through `make test`, "
            "which puts it in .tools/bin (`make tools`)"
        )
    return path


class Prometheus:
    def __init__(self, url: str):
        self.url = url

    def api(self, path: str, **params: str) -> dict:
        q = urllib.parse.urlencode(params, doseq=True)
        with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{q}", timeout=30) as r:
            body = json.loads(r.read())
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        return self.api("query", query=expr)["result"]

    def value(self, expr: str) -> float | None:
        res = self.query(expr)
        return float(res[0]["value"][1]) if res else None

    def last(self, agg: str, series: str) -> float | None:
        """``agg`` over each series' last scraped value in the past minute: one scrape that
        timed out (a busy test machine) marks a series stale, and an instant query would
        then find nothing although the value is known."""
        return self.value(f"{agg}(last_over_time({series}[1m]))")

    def wait_ready(self, proc: subprocess.Popen, log: Path) -> None:
        deadline = time.monotonic() + WAIT_S
        while True:
            assert proc.poll() is None, log.read_text(errors="replace")[-4000:]
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=5) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            assert time.monotonic() < deadline, log.read_text(errors="replace")[-4000:]
            time.sleep(0.5)

    def wait_for(self, expr: str, want: float) -> None:
        """Poll until ``expr`` equals ``want`` (scrapes run every second)."""
        deadline = time.monotonic() + WAIT_S
        while (got := self.value(expr)) != want:
            assert time.monotonic() < deadline, f"{expr} = {got}, want {want}"
            time.sleep(0.5)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("metrics")
    spec = {"method": "dflash", "model": str(assets.DRAFTER), "num_speculative_tokens": 7}
    args = ["--per-request-spec-decode-metrics", "summary"]
    with (
        serve(
            assets.TARGET,
            tmp / "ours.log",
            served_name="ours",
            speculative_config=spec,
            extra_args=args,
            env={"VLLM_DFLASH_BACKEND": "dflash"},
        ) as ours,
        serve(
            assets.TARGET,
            tmp / "builtin.log",
            served_name="builtin",
            speculative_config=spec,
            extra_args=args,
            env={"VLLM_DFLASH_BACKEND": "builtin"},
        ) as builtin,
    ):
        port = free_port()
        targets = [s.url.removeprefix("http://") for s in (ours, builtin)]
        config = tmp / "prometheus.yml"
        config.write_text(
            json.dumps(
                {
                    "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                    "rule_files": [str(RULES)],
                    "scrape_configs": [
                        {"job_name": "vllm", "static_configs": [{"targets": targets}]}
                    ],
                }
            )
        )
        log_path = tmp / "prometheus.log"
        log = log_path.open("wb")
        proc = subprocess.Popen(
            [
                _prometheus_bin(),
                f"--config.file={config}",
                f"--storage.tsdb.path={tmp / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            prom = Prometheus(f"http://127.0.0.1:{port}")
            prom.wait_ready(proc, log_path)
            prom.wait_for('count(up{job="vllm"} == 1)', 2)
            yield prom, {"ours": ours, "builtin": builtin}
        finally:
            proc.terminate()
            proc.wait(timeout=60)
            log.close()


@pytest.fixture(scope="module")
def traffic(stack):
    """The same held-out prompts sent to both servers, 3 at a time; returns each server's
    per-request acceptance lengths as vLLM reports them in the responses."""
    prom, servers = stack
    lines = assets.HELDOUT_PROMPTS.read_text().splitlines()[:NUM_PROMPTS]
    prompts = [json.loads(line)["prompt"] for line in lines]
    taus = {}
    for name, server in servers.items():
        with ThreadPoolExecutor(3) as pool:
            resps = list(pool.map(_complete, [server] * len(prompts), prompts))
        taus[name] = [r["metrics"]["speculative_decoding"]["mean_acceptance_length"] for r in resps]
    prom.wait_for(f'sum({n.REQUEST_ACCEPTANCE_LENGTH}_count{{model_name="ours"}})', NUM_PROMPTS)
    prom.wait_for('count(vllm:spec_decode_num_drafts_total{model_name="builtin"} > 0)', 1)
    return taus


def _complete(server, prompt: str) -> dict:
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    return server.post("/v1/completions", body)


def _substitute(expr: str) -> str:
    return (
        expr.replace("$model_name", ".*")
        .replace("$instance", ".*")
        .replace("$__rate_interval", "1m")
        .replace("$__range", "10m")
    )


def test_every_dashboard_query_returns_data(stack, traffic):
    prom, _ = stack
    queries = dashboard.queries()
    assert len(queries) >= 12
    empty = [(title, expr) for title, expr in queries if not prom.query(_substitute(expr))]
    assert not empty, f"dashboard queries without data: {empty}"


def test_dashboard_variables_find_our_server_only(stack, traffic):
    prom, servers = stack
    metric = f"{n.REQUEST_ACCEPTANCE_LENGTH}_count"
    assert prom.api("label/model_name/values", **{"match[]": metric}) == ["ours"]
    instances = prom.api("label/instance/values", **{"match[]": metric})
    assert instances == [servers["ours"].url.removeprefix("http://")]


def test_acceptance_histogram_mean_equals_the_responses(stack, traffic):
    prom, _ = stack
    sel = '{model_name="ours"}'
    total = prom.last("sum", f"{n.REQUEST_ACCEPTANCE_LENGTH}_sum{sel}")
    count = prom.last("sum", f"{n.REQUEST_ACCEPTANCE_LENGTH}_count{sel}")
    assert count == NUM_PROMPTS
    want = sum(traffic["ours"]) / len(traffic["ours"])
    assert want > 1.3, "the drafter should be accepted at all, or the check is weak"
    assert total / count == pytest.approx(want, rel=0.05)


def test_speedup_and_step_times_are_reported(stack, traffic):
    prom, _ = stack
    sel = '{model_name="ours"}'
    assert prom.last("sum", f"{n.REQUEST_SPEEDUP}_count{sel}") > 0
    assert prom.last("sum", f"{n.BASELINE_SAMPLES}{sel}") > 0
    for hist in (n.DRAFTER_STEP_SECONDS, n.VERIFY_STEP_SECONDS):
        assert prom.last("sum", f"{hist}_count{sel}") > 0, hist
    assert prom.last("max", f"{n.ACCEPTANCE_LENGTH_FLOOR}{sel}") == 1.5


def test_builtin_server_exports_none_of_ours(stack, traffic):
    """VLLM_DFLASH_BACKEND=builtin: vLLM serves as it would without our package."""
    prom, servers = stack
    ours = prom.query('count by (__name__) ({__name__=~"vllm_dflash_.+", model_name="builtin"})')
    assert ours == []
    assert prom.last("sum", 'vllm:spec_decode_num_drafts_total{model_name="builtin"}') > 0
    log = servers["builtin"].log.read_text()
    assert "vllm-dflash stands aside: VLLM_DFLASH_BACKEND=builtin; vLLM is left as it is." in log


def test_alert_rules_load_and_stay_quiet(stack, traffic):
    """Every rule is evaluated on this traffic and is inactive, not even pending: each has
    a ``for:`` of minutes, so none could fire in a run this short, and asserting "not
    firing" would prove nothing. The speedup alert is the exception this machine allows:
    a 2-core CPU may serve the embedded default slower than plain decoding, so its state
    must match the median per-request speedup Prometheus holds (pending below 1)."""
    prom, _ = stack
    landed = time.time()
    deadline = time.monotonic() + WAIT_S
    while True:  # until every rule has been evaluated since the traffic's metrics landed
        rules = {r["name"]: r for g in prom.api("rules")["groups"] for r in g["rules"]}
        if all(_seconds(r["lastEvaluation"]) > landed for r in rules.values()):
            break
        assert time.monotonic() < deadline, rules
        time.sleep(0.5)
    assert {"DFlashAcceptanceLengthLow", "DFlashSpeedupBelowOne", "DFlashNoAcceptedTokens"} <= set(
        rules
    )
    assert all(r["health"] == "ok" for r in rules.values()), rules
    median = prom.value(
        f"histogram_quantile(0.5, sum by (le) "
        f"(rate({n.REQUEST_SPEEDUP}_bucket{{model_name='ours'}}[5m])))"
    )
    assert median is not None
    for name, rule in rules.items():
        slow = name == "DFlashSpeedupBelowOne" and median < 1
        assert rule["state"] == ("pending" if slow else "inactive"), (name, median, rule)


def _seconds(rfc3339: str) -> float:
    """Prometheus's timestamps carry nanoseconds; Python parses microseconds."""
    return datetime.fromisoformat(re.sub(r"(\.\d{6})\d+", r"\1", rfc3339)).timestamp()
