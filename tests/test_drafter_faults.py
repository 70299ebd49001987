"""A drafter fault never takes the engine down (serving/drafter_faults.py).

The guard's own rules run without vLLM. The engine test injects exceptions into our
proposer at random drafting calls through a real engine (tests/fixtures/fault_injector,
loaded through PYTHONPATH): at every site (before the context K/V write, between it and
the block forward, in the context-only path of steps where nobody drafts), of three kinds.
Every request must finish with exactly the tokens of no speculation, every fault must be
counted in our Prometheus counter, and after the configured number of faults drafting
must stop for good (no drafts verified afterwards) with the gauge saying so.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from serving_harness import distilled_drafter, random_prompts, run_engine

from vllm_dflash.errors import DFlashConfigError
from vllm_dflash.serving.drafter_faults import FaultGuard, FaultSettings

INJECTOR = Path(__file__).parent / "fixtures" / "fault_injector"


def _guard(max_faults: int, window: float) -> FaultGuard:
    return FaultGuard(FaultSettings(drafter_max_faults=max_faults, drafter_fault_window_s=window))


def test_drafting_goes_off_after_max_faults_within_the_window():
    g = _guard(3, 10.0)
    for t in (0.0, 4.0):
        g.failed(RuntimeError("boom"), now=t)
    assert not g.off
    g.failed(RuntimeError("boom"), now=9.0)
    assert g.off and g.total == 3


def test_faults_spread_wider_than_the_window_keep_drafting_on():
    g = _guard(3, 10.0)
    for t in (0.0, 6.0, 12.0, 18.0, 24.0, 30.0):  # never 3 within 10 s
        g.failed(RuntimeError("boom"), now=t)
    assert not g.off and g.total == 6


def test_each_kind_of_fault_is_logged_once_with_its_traceback(caplog):
    g = _guard(100, 10.0)
    with caplog.at_level(logging.WARNING, logger="vllm.plugins.vllm_dflash"):
        for i in range(3):
            try:
                raise ValueError("shape mismatch")
            except ValueError as e:
                g.failed(e, now=float(i))
        try:
            raise FloatingPointError("NaN in draft logits")
        except FloatingPointError as e:
            g.failed(e, now=5.0)
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 2  # one per kind
    assert all("Traceback" in r.getMessage() for r in errors)
    repeats = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(repeats) == 2 and all(
        "ValueError: shape mismatch" in r.getMessage() for r in repeats
    )


def test_bad_fault_settings_name_the_variable():
    with pytest.raises(DFlashConfigError, match="VLLM_DFLASH_DRAFTER_MAX_FAULTS"):
        FaultSettings.from_env({"VLLM_DFLASH_DRAFTER_MAX_FAULTS": "0"})


# ---- through a real engine ----------------------------------------------------------------
K = 7
MAX_NEW = 40
MAX_FAULTS = 30


PARITY = random_prompts(1234, 32, 1, 40)  # the distilled drafter's training prompts
MIXED = random_prompts(77, 24, 1, 120)
JOBS = [
    {"name": "c8", "prompts": PARITY, "max_tokens": MAX_NEW, "concurrency": 8},
    {"name": "mixed", "prompts": MIXED, "max_tokens": [5 + 3 * i for i in range(24)]},
    # by now drafting is off (MAX_FAULTS reached): nothing is drafted or verified
    {"name": "after", "prompts": PARITY[:8], "max_tokens": MAX_NEW},
]
POLICY = {  # the draft policy with frequent probes: steps where nobody drafts, and others
    "VLLM_DFLASH_DRAFT_POLICY": "auto",
    "VLLM_DFLASH_POLICY_FIRST_PROBE": "1",
    "VLLM_DFLASH_POLICY_MAX_PROBE": "2",
    "VLLM_DFLASH_POLICY_REFRESH_EVERY": "8",
}


@pytest.fixture(scope="module")
def drafter_dir(target, drafter_dirs, tmp_path_factory):
    out = tmp_path_factory.mktemp("distilled") / "b8"
    return distilled_drafter(target, drafter_dirs[8], out, PARITY)


@pytest.fixture(scope="module")
def faulty(target_dir, drafter_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("faulty")
    faults = tmp / "injected.txt"
    spec = {"method": "dflash", "model": str(drafter_dir), "num_speculative_tokens": K}
    env = POLICY | {
        "PYTHONPATH": str(INJECTOR),
        "DFLASH_TEST_FAULTS": "7:0.12",
        "DFLASH_TEST_FAULTS_LOG": str(faults),
        "VLLM_DFLASH_DRAFTER_MAX_FAULTS": str(MAX_FAULTS),
        "VLLM_DFLASH_DRAFTER_FAULT_WINDOW_S": "36000",
    }
    jobs, log = run_engine(tmp / "run", target_dir, JOBS, spec, env=env, plugin_stat_loggers=True)
    metrics = json.loads((tmp / "run" / "out.json").read_text())["metrics"]
    injected = faults.read_text().split("\n")[:-1] if faults.exists() else []
    return jobs, log, metrics, [line.split() for line in injected]


@pytest.fixture(scope="module")
def plain(target_dir, tmp_path_factory):
    jobs, _ = run_engine(tmp_path_factory.mktemp("plain"), target_dir, JOBS)
    return jobs


def _tokens(job) -> list[list[int]]:
    return [r["tokens"] for r in job["results"]]


@pytest.mark.engine
@pytest.mark.xdist_group("drafter_faults")
def test_faults_hit_every_site_and_kind(faulty):
    _, _, _, injected = faulty
    assert len(injected) == MAX_FAULTS  # after that the drafter is never called again
    assert {site for site, _ in injected} == {"_propose", "_draft_blocks", "context_only"}
    assert {kind for _, kind in injected} == {"shape", "nan", "kernel"}


@pytest.mark.engine
@pytest.mark.xdist_group("drafter_faults")
@pytest.mark.parametrize("job", [j["name"] for j in JOBS])
def test_every_request_finishes_with_the_tokens_of_no_speculation(faulty, plain, job):
    jobs, _, _, _ = faulty
    assert _tokens(jobs[job]) == _tokens(plain[job])


@pytest.mark.engine
@pytest.mark.xdist_group("drafter_faults")
def test_drafts_landed_before_the_faults_turned_drafting_off(faulty):
    jobs, _, _, _ = faulty
    assert jobs["c8"]["spec"]["accepted"] > 0  # speculation was doing real work meanwhile
    assert jobs["after"]["spec"]["drafts"] == 0  # and is off for good once MAX_FAULTS hit


@pytest.mark.engine
@pytest.mark.xdist_group("drafter_faults")
def test_faults_are_counted_logged_and_the_switch_off_is_visible(faulty):
    _, log, metrics, injected = faulty
    assert metrics["vllm_dflash_drafter_faults_total"] == len(injected)
    assert metrics["vllm_dflash_drafter_off"] == 1.0
    assert log.count("vllm-dflash: the drafter failed; this step drafts nothing") == 3  # kinds
    assert "speculation is off for the life of this engine" in log
    assert "Traceback" in log and "injected: NaN in draft logits" in log
