"""Deciding, per engine configuration, whether our proposer serves, and acting on it.

vLLM loads plugins in every process before it builds anything (``plugin.register``):

* In the engine core and the workers the finished configuration is at hand
  (``environment.config_of_loader``): ``decide`` it and ``apply`` at once.
* In the process that parses engine arguments, no configuration exists yet, so ``watch``
  wraps two ``EngineArgs`` methods: ``create_speculative_config`` checks a dflash config
  against its target before vLLM processes it (and sets our defaults), and
  ``create_engine_config`` decides for the configuration it returns.

``apply`` either installs everything serving needs (``install.py``), or, standing aside,
puts back every original vLLM object (``patch.restore_all``), the two watchers included:
vLLM is then exactly as it was, but for our ``VLLM_DFLASH_*`` names in its list of known
environment variables (``vllm_envs.py``). One log line per process says which and why.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from vllm_dflash.serving.seams import patch
from vllm_dflash.serving.seams.decide import BACKEND_ENV, Backend, Decision, for_config
from vllm_dflash.serving.seams.environment import installed, runner_of

# A child of vLLM's "vllm" logger, so the line appears in vLLM's own log output.
logger = logging.getLogger("vllm.plugins.vllm_dflash")

# Our defaults for a dflash speculative config, where the user left the key out.
# * Drafts are sampled from the drafter's marginals q, and the rejection sampler accepts
#   with min(1, p/q) and resamples from max(0, p - q): lossless, and it accepts more than
#   one-hot argmax drafts do. vLLM does this only when asked.
# * vLLM drops the last block of every prefix-cache hit for EAGLE-style methods, dflash
#   included, so that a draft head can recompute it. Our drafter reads only its context
#   K/V, which is written for every token the target computes, in the same step and the
#   same blocks as the target's K/V (``proposer.py``), so a cached block holds it already:
#   keeping the block gives the hit rate of no speculation (docs/draft-policy.md).
SPEC_DEFAULTS = {"draft_sample_method": "probabilistic", "disable_eagle_block_drop": True}


def decide(vllm_config: Any) -> Decision:
    spec = vllm_config.speculative_config
    return for_config(
        installed(),
        Backend.parse(os.environ.get(BACKEND_ENV)),
        None if spec is None else spec.method,
        runner_of(vllm_config),
    )


def apply(decision: Decision) -> None:
    from vllm_dflash.serving import bench_drafts

    logger.info("%s", decision.why)
    if decision.serve:
        from vllm_dflash.serving.install import install

        assert decision.runner is not None
        install(decision.runner)
    else:
        patch.restore_all()
    bench_drafts.install_if_asked()  # whoever drafts: the benchmark's adversarial drafts


def watch() -> None:
    patch.wrap("engine_args.create_speculative_config", _checking_spec_config)
    patch.wrap("engine_args.create_engine_config", _deciding)


def _deciding(create):
    def create_engine_config(self, *args, **kwargs):
        config = create(self, *args, **kwargs)
        apply(decide(config))
        return config

    return create_engine_config


def _checking_spec_config(create):
    def create_speculative_config(self, target_model_config, target_parallel_config):
        # Installed only where our backend is selected (plugin.register).
        spec = {k.replace("-", "_"): v for k, v in (self.speculative_config or {}).items()}
        model = spec.get("model") or self.spec_model
        if (spec.get("method") or self.spec_method) == "dflash" and model:
            from vllm_dflash.serving.adaptive_draft_len import configure
            from vllm_dflash.serving.drafter_config import Parallelism, check_speculative_config

            k = spec.get("num_speculative_tokens") or self.spec_tokens
            check_speculative_config(
                model,
                spec.get("revision"),
                target_model_config.hf_config,
                str(target_model_config.model),
                k,
                Parallelism.of(target_parallel_config, spec.get("draft_tensor_parallel_size")),
            )
            defaults = {key: v for key, v in SPEC_DEFAULTS.items() if key not in spec}
            self.speculative_config = configure(defaults | (self.speculative_config or {}), k)
        return create(self, target_model_config, target_parallel_config)

    return create_speculative_config
