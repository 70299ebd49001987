"""Our Prometheus metrics, exported on the API server's ``/metrics`` next to vLLM's.

Loaded by vLLM's AsyncLLM (``vllm serve``) from the ``vllm.stat_logger_plugins`` entry
point, one instance per engine, in the API server process. It is active only where our
proposer serves (``activate.decide``): otherwise it exports nothing and changes nothing.
Its input is what vLLM's own loggers get: per step, the engine's ``SchedulerStats`` (with
our ``dflash`` field, see ``scheduler_hooks.py``) and the API server's ``IterationStats``.
Two small hooks on ``IterationStats`` (seam ``iteration_stats``) note, per request, the
tokens of each decoding step, so that when a request finishes we know:

* its acceptance length: tokens emitted / verify steps (baseline steps, which verify
  nothing, are not counted);
* its speedup: (decode tokens / decode seconds, vLLM's own per-request decode time)
  times the measured no-speculation step time at its mean decode batch size.

Acceptance counters (drafted, accepted, per position) are vLLM's ``vllm:spec_decode_*``
series, not duplicated here.
"""

from __future__ import annotations

from typing import Any

import prometheus_client
from vllm.config import VllmConfig
from vllm.v1.metrics.loggers import StatLoggerBase

from vllm_dflash.observability import names
from vllm_dflash.observability.baseline import (
    BaselineTable,
    MetricsSettings,
    RequestCounters,
    request_speedup,
)
from vllm_dflash.serving.activate import decide
from vllm_dflash.serving.scheduler_hooks import FIELD
from vllm_dflash.serving.seams import patch

_DECODED = "_dflash_decoded"  # IterationStats: [(RequestStateStats, n tokens)] this step
_REQ = "_dflash_req"  # FinishedRequestStats -> the request's RequestStateStats
_COUNTS = "_dflash_counts"  # RequestStateStats -> RequestCounters


def _noting_decoded(update):
    def update_from_output(self, output, engine_core_timestamp, is_prefilling, req_stats, *a):
        update(self, output, engine_core_timestamp, is_prefilling, req_stats, *a)
        if not is_prefilling and output.new_token_ids:
            self.__dict__.setdefault(_DECODED, []).append((req_stats, len(output.new_token_ids)))

    return update_from_output


def _noting_request(finished):
    def update_from_finished_request(self, *args, **kwargs):
        finished(self, *args, **kwargs)
        req = kwargs["req_stats"] if "req_stats" in kwargs else args[4]
        setattr(self.finished_requests[-1], _REQ, req)

    return update_from_finished_request


def _hook_iteration_stats() -> None:
    patch.wrap("iteration_stats", _noting_decoded, member="update_from_output")
    patch.wrap("iteration_stats", _noting_request, member="update_from_finished_request")


_METRICS: dict[str, Any] = {}


def _metrics() -> dict[str, Any]:
    """Created once per process: vLLM may build a logger per engine, and again per
    AsyncLLM, but a Prometheus registry takes each name once."""
    if _METRICS:
        return _METRICS
    labels = list(names.LABELS)
    h = prometheus_client.Histogram
    _METRICS.update(
        tau=h(
            names.REQUEST_ACCEPTANCE_LENGTH,
            "Per finished request: tokens emitted per verify step (1 = no draft accepted).",
            labels,
            buckets=names.ACCEPTANCE_LENGTH_BUCKETS,
        ),
        speedup=h(
            names.REQUEST_SPEEDUP,
            "Per finished request: decode rate over the measured no-speculation decode "
            "rate of this engine at the request's mean batch size.",
            labels,
            buckets=names.SPEEDUP_BUCKETS,
        ),
        drafter=h(
            names.DRAFTER_STEP_SECONDS,
            "Model-runner time in the drafter, per engine step.",
            labels,
            buckets=names.STEP_SECONDS_BUCKETS,
        ),
        verify=h(
            names.VERIFY_STEP_SECONDS,
            "Model-runner time outside the drafter (target forward, verification), per step.",
            labels,
            buckets=names.STEP_SECONDS_BUCKETS,
        ),
        baseline=prometheus_client.Gauge(
            names.BASELINE_STEP_SECONDS,
            "Measured no-speculation decode step time (median of recent baseline steps).",
            [*labels, "batch_size"],
            multiprocess_mode="mostrecent",
        ),
        samples=prometheus_client.Counter(
            names.BASELINE_SAMPLES.removesuffix("_total"),
            "Baseline (no-speculation) steps measured.",
            labels,
        ),
        faults=prometheus_client.Counter(
            names.DRAFTER_FAULTS.removesuffix("_total"),
            "Drafting steps that raised; each such step drafted nothing and its output was "
            "unchanged.",
            labels,
        ),
        off=prometheus_client.Gauge(
            names.DRAFTER_OFF,
            "1 once drafting is switched off after too many drafter faults "
            "(VLLM_DFLASH_DRAFTER_MAX_FAULTS within VLLM_DFLASH_DRAFTER_FAULT_WINDOW_S).",
            labels,
            multiprocess_mode="mostrecent",
        ),
        floor=prometheus_client.Gauge(
            names.ACCEPTANCE_LENGTH_FLOOR,
            "Mean acceptance length below which the DFlashAcceptanceLengthLow alert fires "
            "(VLLM_DFLASH_ACCEPTANCE_FLOOR).",
            labels,
            multiprocess_mode="mostrecent",
        ),
    )
    return _METRICS


class DFlashStatLogger(StatLoggerBase):
    def __init__(self, vllm_config: VllmConfig, engine_index: int = 0):
        self.active = False
        if decide(vllm_config).serve:
            self.start(vllm_config, engine_index)

    def start(self, vllm_config: VllmConfig, engine_index: int) -> None:
        self.active = True
        _hook_iteration_stats()
        settings = MetricsSettings.from_env()
        self.table = BaselineTable()
        model = vllm_config.model_config.served_model_name
        self.labels = {"model_name": model, "engine": str(engine_index)}
        m = _metrics()
        self.tau, self.speedup = m["tau"].labels(**self.labels), m["speedup"].labels(**self.labels)
        self.drafter = m["drafter"].labels(**self.labels)
        self.verify = m["verify"].labels(**self.labels)
        self.samples = m["samples"].labels(**self.labels)
        self.faults = m["faults"].labels(**self.labels)
        self.off = m["off"].labels(**self.labels)
        self.off.set(0)
        self.baseline_gauge = m["baseline"]
        m["floor"].labels(**self.labels).set(settings.acceptance_floor)

    def record(
        self,
        scheduler_stats: Any,
        iteration_stats: Any,
        mm_cache_stats: Any = None,
        engine_idx: int = 0,
    ) -> None:
        if not self.active:
            return
        step = getattr(scheduler_stats, FIELD, None) or {}
        if step:
            self._record_step(step)
        if iteration_stats is None:
            return
        decoded = iteration_stats.__dict__.get(_DECODED, ())
        if decoded and not step.get("no_verify"):
            batch = len(decoded)
            for req, n in decoded:
                c = req.__dict__.get(_COUNTS)
                if c is None:
                    c = req.__dict__[_COUNTS] = RequestCounters()
                c.verify_steps += 1
                c.verify_tokens += n
                c.batch_sum += batch
        for fin in iteration_stats.finished_requests:
            req = getattr(fin, _REQ, None)
            c = None if req is None else req.__dict__.get(_COUNTS)
            if c is None:
                continue  # finished before any verify step (e.g. a 1-token request)
            self.tau.observe(c.acceptance_length())
            speed = request_speedup(
                fin.num_generation_tokens - 1, fin.decode_time, c.mean_batch(), self.table
            )
            if speed is not None:
                self.speedup.observe(speed)

    def _record_step(self, step: dict[str, Any]) -> None:
        for s in step.get("drafter_s", ()):
            self.drafter.observe(s)
        for s in step.get("verify_s", ()):
            self.verify.observe(s)
        if faults := step.get("drafter_faults"):
            self.faults.inc(faults)
        if step.get("drafter_off"):
            self.off.set(1)
        samples = step.get("baseline", ())
        for batch, secs in samples:
            self.table.add(int(batch), float(secs))
            self.samples.inc()
        if samples:
            for b, secs in self.table.medians().items():
                self.baseline_gauge.labels(**self.labels, batch_size=str(b)).set(secs)

    def log_engine_initialized(self) -> None:
        pass
