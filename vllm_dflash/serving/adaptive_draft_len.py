"""The adaptive draft length (``adaptive/controller.py``) inside vLLM's scheduler.

It rides on vLLM's own *dynamic speculative decoding*: when a speculative config carries
``num_speculative_tokens_per_batch_size``, vLLM reads each step's draft length from
``Scheduler.dynamic_sd_lookup[batch size]``, passes it to the drafter as
``num_speculative_tokens``, reserves cache slots for the drafts that come back, and, knowing
the length varies, stops padding decode steps to a uniform query length and refuses data
parallelism. So:

* ``configure``: with ``VLLM_DFLASH_ADAPTIVE=1``, the engine-argument hook adds a schedule
  to our dflash speculative config (vLLM then runs in that mode); a schedule the user gave
  is an error (one policy at a time). The schedule names every length 1..K, because runner
  V2 captures a decode CUDA graph for each length its schedule can return; the controller
  then replaces the lookup, so which batch size maps to which length does not matter.
* ``controller_for``: the scheduler's lookup asks the controller (``scheduler_hooks.py``
  installs it), and ``observe`` feeds it what each step accepted and what the runner
  measured (``step_timing.py``).

On runner V1 our proposer drafts exactly the length asked; on runner V2, vLLM's DFlash
orchestration drafts all K in its captured graph and the runner verifies the first draft_len
(docs/vllm-support.md), so there the shorter length saves verification only.

The verifier is untouched, so outputs stay exactly those of vLLM's rejection sampling.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

from vllm_dflash.adaptive.controller import AdaptiveSettings, DraftLenController
from vllm_dflash.errors import DFlashConfigError
from vllm_dflash.serving.draft_plan import verified

SCHEDULE_KEY = "num_speculative_tokens_per_batch_size"
_ALL_BATCHES = 1 << 20  # vLLM clips a range to max_num_seqs, and a K to the configured K

logger = logging.getLogger("vllm.plugins.vllm_dflash")

# Controllers of the schedulers in this process (the benchmark reads and steers them).
LIVE: weakref.WeakSet[DraftLenController] = weakref.WeakSet()


def configure(spec: dict[str, Any], k: int | None) -> dict[str, Any]:
    """The dflash speculative config to hand to vLLM, with the adaptive schedule when on
    (``k``: the draft tokens asked for, None when vLLM fills it in from the drafter)."""
    if not AdaptiveSettings.from_env().adaptive:
        return spec
    if any(k.replace("-", "_") == SCHEDULE_KEY and v is not None for k, v in spec.items()):
        raise DFlashConfigError(
            f"--speculative-config {SCHEDULE_KEY} and VLLM_DFLASH_ADAPTIVE=1 both choose "
            "the draft length. Fix: drop one of them"
        )
    k = k or 1  # without a K vLLM uses the drafter's: its full block comes from the last range
    schedule = [[g, g, g] for g in range(1, k)] + [[k, _ALL_BATCHES, _ALL_BATCHES]]
    return {**spec, SCHEDULE_KEY: schedule}


class _Lookup:
    """Stands in for vLLM's dense batch-size -> K list."""

    def __init__(self, controller: DraftLenController) -> None:
        self.controller = controller

    def __getitem__(self, batch: int) -> int:
        return self.controller.choose(batch)


def controller_for(scheduler: Any) -> DraftLenController | None:
    """Installs the controller as ``scheduler``'s draft-length lookup when adaptive is on."""
    if not AdaptiveSettings.from_env().adaptive:
        return None
    if scheduler.dynamic_sd_lookup is None:  # vLLM turned it off (data parallelism)
        logger.warning(
            "vllm-dflash: VLLM_DFLASH_ADAPTIVE=1 has no effect: vLLM runs without "
            "dynamic speculative decoding here, so every step drafts %d tokens",
            scheduler.num_spec_tokens,
        )
        return None
    controller = DraftLenController(scheduler.num_spec_tokens, AdaptiveSettings.from_env())
    LIVE.add(controller)
    scheduler.dynamic_sd_lookup = _Lookup(controller)
    return controller


def observe(controller: DraftLenController, so: Any, mro: Any, timings: list[Any]) -> None:
    for _, drafted, accepted in verified(so, mro):
        controller.observe_verify(drafted, accepted)
    for t in timings:
        if t.decode_only:
            controller.observe_step(t.batch, t.drafted_len, t.drafter_s, t.verified_len, t.verify_s)
