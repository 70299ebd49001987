"""The draft policy (adaptive/policy.py) serving through real vLLM (CPU build), one engine.

The drafter is distilled on the PARITY prompts (tests/test_serving_greedy.py does the same),
so greedy requests on them are accepted often; greedy requests restricted to two tokens
(``allowed_token_ids``, which the rejection sampler applies to the target) are almost never
accepted, as the drafter does not know the restriction. With the policy's probes made
frequent, requests switch between drafting and not, one at a time, while others in the
same step draft: every greedy output must still equal no speculation's, token for token.
Seeded requests must repeat their tokens in any batch; vLLM's built-in, which draws drafts
from the global random stream, is the negative control.
"""

from __future__ import annotations

import random

import pytest
from serving_harness import distilled_drafter, random_prompts, run_engine

pytestmark = [pytest.mark.engine, pytest.mark.xdist_group("draft_policy_engine")]
K = 7
MAX_NEW = 40


PARITY = random_prompts(1234, 32, 1, 40)  # the distilled drafter's training prompts
MIXED = random_prompts(99, 48, 1, 200)
MIXED_MAX = [random.Random(i).randint(5, 60) for i in range(48)]
SEEDED = PARITY[0]
OTHERS = random_prompts(5, 7, 5, 30)
POLICY_ENV = {
    "VLLM_DFLASH_DRAFT_POLICY": "auto",
    "VLLM_DFLASH_POLICY_FIRST_PROBE": "1",
    "VLLM_DFLASH_POLICY_MAX_PROBE": "3",
    "VLLM_DFLASH_POLICY_REFRESH_EVERY": "8",
}
NARROW = [2, 3]  # the only tokens a restricted request may produce


def _restricted(flags: list[bool]) -> list[list[int] | None]:
    return [NARROW if f else None for f in flags]


def _seeded_jobs() -> list[dict]:
    sampled = {"temperature": 0.8, "max_tokens": MAX_NEW}
    return [
        {"name": "seed_alone", "prompts": [SEEDED], "seeds": [100], **sampled},
        {"name": "seed_crowd", "prompts": [SEEDED, *OTHERS], "seeds": [100, *range(7)], **sampled},
        {
            "name": "seed_twins",
            "prompts": [SEEDED] * 8,
            "seeds": [100, 100, 7, 7, 8, 8, 9, 9],
            **sampled,
        },
    ]


@pytest.fixture(scope="module")
def drafter_dir(target, drafter_dirs, tmp_path_factory):
    return distilled_drafter(
        target, drafter_dirs[8], tmp_path_factory.mktemp("distilled") / "b8", PARITY
    )


def _greedy_jobs() -> list[dict]:
    half = PARITY[:16]
    return [
        {"name": "c1", "prompts": PARITY[:12], "max_tokens": MAX_NEW, "concurrency": 1},
        {"name": "c8", "prompts": PARITY, "max_tokens": MAX_NEW, "concurrency": 8},
        {"name": "mixed48", "prompts": MIXED, "max_tokens": MIXED_MAX},
        # requests whose drafts land, whose drafts miss, and both in the same steps
        {"name": "landing", "prompts": half[:8], "max_tokens": MAX_NEW},
        {
            "name": "missing",
            "prompts": half[8:],
            "max_tokens": MAX_NEW,
            "allowed_token_ids": _restricted([True] * 8),
        },
        {
            "name": "both",
            "prompts": half,
            "max_tokens": MAX_NEW,
            "allowed_token_ids": _restricted([False] * 8 + [True] * 8),
        },
    ]


ENGINE = {"block_size": 32, "num_gpu_blocks_override": 24, "max_num_seqs": 64}


@pytest.fixture(scope="module")
def served(target_dir, drafter_dir, tmp_path_factory):
    spec = {"method": "dflash", "model": str(drafter_dir), "num_speculative_tokens": K}
    jobs = [*_greedy_jobs(), *_seeded_jobs()]
    tmp = tmp_path_factory.mktemp("policy")
    return run_engine(tmp, target_dir, jobs, spec, engine=ENGINE, env=POLICY_ENV)


@pytest.fixture(scope="module")
def plain(target_dir, tmp_path_factory):
    jobs, _ = run_engine(
        tmp_path_factory.mktemp("plain"), target_dir, _greedy_jobs(), engine=ENGINE
    )
    return jobs


@pytest.fixture(scope="module")
def builtin(target_dir, drafter_dir, tmp_path_factory):
    spec = {"method": "dflash", "model": str(drafter_dir), "num_speculative_tokens": K}
    tmp = tmp_path_factory.mktemp("builtin")
    jobs, _ = run_engine(tmp, target_dir, _seeded_jobs()[2:], spec, backend="builtin")
    return jobs


def _tokens(job) -> list[list[int]]:
    return [r["tokens"] for r in job["results"]]


def _drafting_share(job) -> float:
    """Of the steps its requests decoded, the share that verified drafts."""
    spec = job["spec"]
    decoded = sum(len(t) - 1 for t in _tokens(job))  # tokens after the prefill's
    return spec["drafts"] / max(decoded - spec["accepted"], 1)


def test_log_says_the_policy_serves(served):
    _, log = served
    assert "draft policy 'auto'" in log


@pytest.mark.parametrize("job", ["c1", "c8", "mixed48", "landing", "missing", "both"])
def test_greedy_identical_to_no_speculation(served, plain, job):
    jobs, _ = served
    assert _tokens(jobs[job]) == _tokens(plain[job])


def test_requests_that_miss_draft_less_than_the_others(served):
    """Whether a request drafts depends on the step costs the engine measures, and so on
    the machine's load: a loaded run moved the shares from 0.82 / 0.30 to 0.66 / 0.46. So
    this asserts only what holds under any load: requests that miss draft in fewer of
    their steps than requests that land, and fewer than fixed K (every step). The exact
    behaviour, on fixed costs, is tests/test_draft_policy.py's."""
    jobs, _ = served
    landing, missing = _drafting_share(jobs["landing"]), _drafting_share(jobs["missing"])
    print(f"drafting share: landing {landing:.2f}, missing {missing:.2f}")  # see with -s
    assert missing < 0.8 and missing < landing, (landing, missing)


def test_seeded_request_repeats_in_any_batch(served):
    jobs, _ = served
    alone = _tokens(jobs["seed_alone"])[0]
    assert _tokens(jobs["seed_crowd"])[0] == alone
    twins = _tokens(jobs["seed_twins"])
    assert twins[0] == alone
    assert twins[2] == twins[3] and twins[4] == twins[5] and twins[6] == twins[7]
    assert twins[1] == alone
    assert len({tuple(t) for t in twins}) > 2  # different seeds do differ


def test_builtin_draws_drafts_from_the_global_stream(builtin):
    """The negative control: the same check catches vLLM's built-in."""
    twins = _tokens(builtin["seed_twins"])
    assert any(twins[i] != twins[i + 1] for i in range(0, 8, 2)), twins
