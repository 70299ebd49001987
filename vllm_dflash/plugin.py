"""vLLM plugin entry point (``vllm.general_plugins``), loaded by vLLM in every process.

Our proposer serves ``method: "dflash"`` wherever the installed vLLM, its model runner and
platform are a combination we serve (``versions.py``); everywhere else, and with
``VLLM_DFLASH_BACKEND=builtin`` or another speculative method, vLLM is left exactly as it
was and its own implementation serves. One log line per process says which, and why
(``serving/seams/decide.py`` decides, ``serving/activate.py`` acts). In every case our
``VLLM_DFLASH_*`` variables join vLLM's known environment variables
(``serving/vllm_envs.py``).
"""

from __future__ import annotations

import logging
import os

from vllm_dflash.serving.seams.decide import (
    BACKEND_ENV,
    BACKENDS,
    Backend,
    before_config,
    servable,
)

__all__ = ["BACKENDS", "BACKEND_ENV", "register"]

# A child of vLLM's "vllm" logger, so the line appears in vLLM's own log output.
logger = logging.getLogger("vllm.plugins.vllm_dflash")


def register() -> None:
    from vllm_dflash.serving import vllm_envs

    vllm_envs.register(known_variables())  # before vLLM validates the environment
    backend = Backend.parse(os.environ.get(BACKEND_ENV))  # a typo stops the start
    from vllm_dflash.serving.seams.environment import installed

    early = before_config(installed(), backend)
    if early is not None:
        logger.info("%s", early.why)
        if backend.name == "builtin" and servable(installed()):
            from vllm_dflash.serving import bench_drafts

            bench_drafts.install_if_asked()  # vLLM's own dflash under the bench's drafts
        return
    _check_settings()  # a bad VLLM_DFLASH_* value stops the start, naming it
    from vllm_dflash.serving import activate
    from vllm_dflash.serving.seams.environment import config_of_loader

    config = config_of_loader()
    if config is None:  # the argument parser's process: no configuration yet
        activate.watch()
    else:  # an engine core or a worker: the configuration is here
        activate.apply(activate.decide(config))


def settings_classes() -> tuple[type, ...]:
    from vllm_dflash.adaptive.controller import AdaptiveSettings
    from vllm_dflash.adaptive.policy import PolicySettings
    from vllm_dflash.observability.baseline import MetricsSettings
    from vllm_dflash.ops import CustomOpSettings
    from vllm_dflash.serving.bench_drafts import BenchDraftSettings
    from vllm_dflash.serving.drafter_faults import FaultSettings

    return (
        MetricsSettings,
        AdaptiveSettings,
        PolicySettings,
        CustomOpSettings,
        BenchDraftSettings,
        FaultSettings,
    )


# Ours, outside the settings classes: the bench's result channel, and the build switch.
OTHER_VARIABLES = ("VLLM_DFLASH_BENCH_FD", "VLLM_DFLASH_BUILD_OPS")


def known_variables() -> list[str]:
    """Every ``VLLM_DFLASH_*`` environment variable the package reads."""
    from vllm_dflash.env_settings import ENV_PREFIX

    fields = {ENV_PREFIX + f.upper() for s in settings_classes() for f in s.model_fields}
    return sorted(fields | {BACKEND_ENV, *OTHER_VARIABLES})


def _check_settings() -> None:
    for settings in settings_classes():
        settings.from_env()
