"""The draft policy's route on runner V2, through vLLM's real scheduler.

Runner V2 cannot run here (it needs CUDA and Triton), and the model runner is not what
carries the policy's lengths: the scheduler is. ``scheduler_probe.py`` drives the installed
vLLM's ``Scheduler`` and ``AsyncScheduler`` with our hooks and a runner-V2 policy (shared
drafter), answering each step the way V2 does (the seam behaviours that the contract tests
check in the 0.32, 0.33 and 0.34 sources): every request gets the step's
``num_spec_tokens_to_schedule`` drafts, and verifies what was scheduled for it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from factory import make_drafter, make_target
from scheduler_probe import CONTINUATION, MAX_TOKENS, K

PROBE = Path(__file__).with_name("scheduler_probe.py")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("v2-route")
    target = make_target(root / "target")
    return target, make_drafter(root / "drafter", target)


def _probe(models, mode: str, tmp_path: Path) -> dict:
    out = tmp_path / f"{mode}.json"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    proc = subprocess.run(
        [sys.executable, str(PROBE), str(out), *map(str, models), mode],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_each_request_verifies_the_length_planned_for_it(models, tmp_path, mode):
    run = _probe(models, mode, tmp_path)
    steps = run["steps"]
    assert run["left"] == [] and set(run["tokens"].values()) == {MAX_TOKENS}
    for i, s in enumerate(steps):
        assert s["scheduled"] == s["planned"], (i, s)  # the cut reached the scheduler
        assert s["step_length"] == max(s["plan"].values(), default=0), (i, s)  # V2 drafts it
        assert len(set(s["plan"].values())) <= 1, (i, s)  # one length for the batch
    # While the good requests run, the batch drafts K; once only the bad ones are left
    # it decodes plainly, but for probes of one draft.
    both = [s for s in steps if "good0" in s["plan"] and "bad0" in s["plan"]]
    alone = [s for s in steps if "good0" not in s["plan"] and "good1" not in s["plan"]]
    assert sum(s["step_length"] == K for s in both) >= 0.7 * len(both)
    late = alone[len(alone) // 3 :]
    assert late and all(s["step_length"] in (0, 1) for s in late), late
    assert sum(s["step_length"] == 0 for s in late) >= 0.8 * len(late)
    if mode == "async":  # vLLM 0.32's placeholder list is shared: never cut in place
        assert run["placeholders"] == [-1] * K


def test_without_the_cut_the_scheduler_schedules_what_was_not_planned(models, tmp_path):
    """The negative control: with our cut of each request's drafts switched off, vLLM's
    async placeholders schedule K drafts where the policy planned none."""
    steps = _probe(models, "async-nocut", tmp_path)["steps"]
    assert any(s["scheduled"] != s["planned"] for s in steps)


@pytest.mark.parametrize("drafts", ["always", "never"])
def test_the_benchs_adversarial_drafts_reach_the_scheduler(models, tmp_path, drafts):
    """``vllm-dflash bench --drafts always|never``: whatever the drafter drafted (wrong
    tokens for ``always``, the continuation itself for ``never``), the scheduler keeps the
    target's continuation at those positions (every draft accepted) or a token that
    differs from it at every position (none accepted)."""
    kept = _probe(models, f"bench-{drafts}", tmp_path)["kept"]
    pairs = [(n, d) for step in kept for n, d in step.values() if d]
    assert len(pairs) > 50
    for n, d in pairs:
        want = CONTINUATION[n : n + len(d)]
        if drafts == "always":
            assert d == want, (n, d)
        else:
            assert all(a != b for a, b in zip(d, want, strict=True)), (n, d)
