"""Prefix caching with our drafter: the hit rate of no speculation, with nothing lost.

vLLM drops the last block of every prefix-cache hit for EAGLE-style methods; our default
``disable_eagle_block_drop`` keeps it (serving/activate.py), because the drafter reads only
its context K/V, written for every token the target computes. The same long-prefix prompts
are sent twice, and their shared prefix ends in the middle of a block. Then:

* our engine hits the cache exactly as often as the same engine without speculation;
* every greedy output equals no speculation's;
* the second pass, drafting from cached context K/V, is accepted as often as the first,
  which computed it: a stale or missing context K/V would draft worse.
"""

from __future__ import annotations

import pytest
from serving_harness import distilled_drafter, mean_acceptance_length, random_prompts, run_engine

pytestmark = [pytest.mark.engine, pytest.mark.xdist_group("prefix_caching")]
K = 7
NEW = 24


SHARED = random_prompts(21, 1, 80, 80)[0]  # 2.5 blocks of 32: hits end in the middle of a block
PROMPTS = [SHARED + tail for tail in random_prompts(22, 8, 3, 40)]
JOBS = [
    {"name": "first", "prompts": PROMPTS, "max_tokens": NEW, "concurrency": 1},
    {"name": "again", "prompts": PROMPTS, "max_tokens": NEW, "concurrency": 1},
]
ENGINE = {"block_size": 32, "enable_prefix_caching": True}


@pytest.fixture(scope="module")
def drafter_dir(target, drafter_dirs, tmp_path_factory):
    """Distilled on these prompts, so that drafts are often right and a worse context
    shows as lower acceptance."""
    return distilled_drafter(target, drafter_dirs[8], tmp_path_factory.mktemp("d") / "b8", PROMPTS)


@pytest.fixture(scope="module")
def ours(target_dir, drafter_dir, tmp_path_factory):
    spec = {"method": "dflash", "model": str(drafter_dir), "num_speculative_tokens": K}
    env = {"VLLM_DFLASH_BASELINE_EVERY": "0"}
    jobs, log = run_engine(tmp_path_factory.mktemp("ours"), target_dir, JOBS, spec, ENGINE, env=env)
    return jobs, log


@pytest.fixture(scope="module")
def plain(target_dir, tmp_path_factory):
    jobs, _ = run_engine(tmp_path_factory.mktemp("plain"), target_dir, JOBS, engine=ENGINE)
    return jobs


def _tokens(job) -> list[list[int]]:
    return [r["tokens"] for r in job["results"]]


def test_hit_rate_equals_no_speculation(ours, plain):
    jobs, log = ours
    assert "block dropping is disabled" in log  # vLLM's own line: the default took effect
    for name in ("first", "again"):
        assert jobs[name]["spec"]["prefix_hits"] == plain[name]["spec"]["prefix_hits"], name
    assert plain["again"]["spec"]["prefix_hits"] > plain["first"]["spec"]["prefix_hits"] > 0


@pytest.mark.parametrize("name", ["first", "again"])
def test_greedy_identical_to_no_speculation(ours, plain, name):
    jobs, _ = ours
    assert _tokens(jobs[name]) == _tokens(plain[name])


def test_cached_context_drafts_as_well_as_computed(ours):
    jobs, _ = ours
    first = mean_acceptance_length(jobs["first"]["spec"])
    again = mean_acceptance_length(jobs["again"]["spec"])
    print(f"acceptance length: first pass {first:.3f}, from the cache {again:.3f}")
    assert first > 2.0
    assert again == pytest.approx(first, rel=0.02)
