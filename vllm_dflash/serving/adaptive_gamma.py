"""The adaptive draft length (``adaptive/controller.py``) inside vLLM's scheduler.

It rides on vLLM's own *dynamic speculative decoding*: when a speculative config carries
``num_speculative_tokens_per_batch_size``, vLLM reads each step's draft length from
``Scheduler.dynamic_sd_lookup[batch size]``, passes it to the proposer as
``num_speculative_tokens`` (ours drafts any 1..K), reserves cache slots for the drafts that
come back, and, knowing the length varies, stops padding decode steps to a uniform query
length, captures CUDA graphs piecewise and refuses data parallelism. So:

* ``configure``: with ``VLLM_DFLASH_ADAPTIVE=1``, the engine-argument hook adds a schedule
  of K for every batch size to our dflash speculative config (vLLM then runs in that mode);
  a schedule the user gave is an error (one policy at a time).
* ``install``: every Scheduler built with such a config gets a lookup that asks the
  controller, and its ``update_from_output`` feeds the controller what each step
  accepted and what the model runner measured (``step_stats.py``).

The verifier is untouched, so outputs stay exactly those of vLLM's rejection sampling.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

from vllm_dflash.adaptive.controller import AdaptiveSettings, GammaController
from vllm_dflash.errors import DFlashConfigError
from vllm_dflash.serving.install import after_import

SCHEDULER_MODULE = "vllm.v1.core.sched.scheduler"
SCHEDULE_KEY = "num_speculative_tokens_per_batch_size"
_ALL_BATCHES = 1 << 20  # vLLM clips a range to max_num_seqs, and a K to the configured K

logger = logging.getLogger("vllm.plugins.vllm_dflash")

# Controllers of the schedulers in this process (the benchmark reads and steers them).
LIVE: weakref.WeakSet[GammaController] = weakref.WeakSet()


def configure(spec: dict[str, Any]) -> dict[str, Any]:
    """The dflash speculative config to hand to vLLM, with the adaptive schedule when on."""
    if not AdaptiveSettings.from_env().adaptive:
        return spec
    if any(k.replace("-", "_") == SCHEDULE_KEY and v is not None for k, v in spec.items()):
        raise DFlashConfigError(
            f"--speculative-config {SCHEDULE_KEY} and VLLM_DFLASH_ADAPTIVE=1 both choose "
            "the draft length. Fix: drop one of them"
        )
    return {**spec, SCHEDULE_KEY: [[1, _ALL_BATCHES, _ALL_BATCHES]]}


def install() -> None:
    AdaptiveSettings.from_env()  # a bad value stops the start, naming it
    after_import(SCHEDULER_MODULE, _hook_scheduler)


class _Lookup:
    """Stands in for vLLM's dense batch-size -> K list."""

    def __init__(self, controller: GammaController) -> None:
        self.controller = controller

    def __getitem__(self, batch: int) -> int:
        return self.controller.choose(batch)


def _hook_scheduler(sched_module: Any) -> None:
    cls = sched_module.Scheduler
    if getattr(cls.__init__, "_vllm_dflash_adaptive", False):
        return
    init, update = cls.__init__, cls.update_from_output

    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        settings = AdaptiveSettings.from_env()
        spec = self.vllm_config.speculative_config
        if not (settings.adaptive and spec and spec.method == "dflash"):
            return
        if self.dynamic_sd_lookup is None:  # vLLM turned it off (data parallelism)
            logger.warning(
                "vllm-dflash: VLLM_DFLASH_ADAPTIVE=1 has no effect: vLLM runs without "
                "dynamic speculative decoding here, so every step drafts %d tokens",
                self.num_spec_tokens,
            )
            return
        self._dflash_gamma = GammaController(self.num_spec_tokens, settings)
        LIVE.add(self._dflash_gamma)
        self.dynamic_sd_lookup = _Lookup(self._dflash_gamma)

    def update_from_output(self, scheduler_output, model_runner_output):
        controller = self.__dict__.get("_dflash_gamma")
        if controller is not None:
            _observe(controller, scheduler_output, model_runner_output)
        return update(self, scheduler_output, model_runner_output)

    __init__._vllm_dflash_adaptive = True  # type: ignore[attr-defined]
    cls.__init__ = __init__
    cls.update_from_output = update_from_output


def _observe(controller: GammaController, so: Any, mro: Any) -> None:
    index = getattr(mro, "req_id_to_index", None) or {}
    sampled = getattr(mro, "sampled_token_ids", None) or []
    invalid = so.num_invalid_spec_tokens or {}  # drafts a grammar rejected: not verified
    for req_id, drafts in so.scheduled_spec_decode_tokens.items():
        i = index.get(req_id)
        if i is not None and i < len(sampled) and sampled[i]:
            controller.observe_verify(len(drafts) - invalid.get(req_id, 0), len(sampled[i]) - 1)
    for t in getattr(mro, "dflash_timings", None) or []:
        if t["decode_only"]:
            controller.observe_step(
                t["batch"], t["draft_gamma"], t["drafter_s"], t["verify_gamma"], t["verify_s"]
            )
