"""Put our drafter and proposer where vLLM 0.32 looks for the ``dflash`` method.

* The drafter model class is registered for the ``DFlashDraftModel`` architecture through
  vLLM's public ``ModelRegistry``.
* The engine-argument parser is wrapped so a dflash speculative config is checked against
  its target (``drafter_config.check_speculative_config``) before vLLM processes it, and
  gets the adaptive draft-length schedule when that is on (``adaptive_gamma.configure``).
* vLLM's model runner builds ``DFlashProposer`` from a name bound in its own module
  (``vllm.v1.worker.gpu_model_runner``), and checks ``isinstance(drafter, DFlashProposer)``
  against that same name, so rebinding that one name swaps the proposer everywhere. The
  runner module is heavy, so it is not imported here: the swap happens right after the
  process imports it (vLLM loads plugins before it imports its worker classes).
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from collections.abc import Callable
from types import ModuleType

RUNNER_MODULE = "vllm.v1.worker.gpu_model_runner"
ARGS_MODULE = "vllm.engine.arg_utils"
DRAFTER_CLASS = "vllm_dflash.serving.drafter_model:DFlashDraftModel"


def install() -> None:
    from vllm import ModelRegistry

    from vllm_dflash.serving import cpu_sampler_fix

    cpu_sampler_fix.install()

    ModelRegistry.register_model("DFlashDraftModel", DRAFTER_CLASS)
    after_import(RUNNER_MODULE, _swap_proposer)
    after_import(ARGS_MODULE, _check_before_vllm)


def _swap_proposer(runner_module: ModuleType) -> None:
    from vllm_dflash.serving.proposer import DFlashProposer

    runner_module.DFlashProposer = DFlashProposer


def _check_before_vllm(args_module: ModuleType) -> None:
    """Validate a dflash speculative config against its target before vLLM processes it."""
    from vllm_dflash.serving.adaptive_gamma import configure
    from vllm_dflash.serving.drafter_config import Parallelism, check_speculative_config

    engine_args = args_module.EngineArgs
    create = engine_args.create_speculative_config
    if getattr(create, "_vllm_dflash", False):
        return

    def create_speculative_config(self, target_model_config, target_parallel_config):
        spec = {k.replace("-", "_"): v for k, v in (self.speculative_config or {}).items()}
        model = spec.get("model") or self.spec_model
        if (spec.get("method") or self.spec_method) == "dflash" and model:
            check_speculative_config(
                model,
                spec.get("revision"),
                target_model_config.hf_config,
                str(target_model_config.model),
                spec.get("num_speculative_tokens") or self.spec_tokens,
                Parallelism.of(target_parallel_config, spec.get("draft_tensor_parallel_size")),
            )
            self.speculative_config = configure(self.speculative_config or {})
        return create(self, target_model_config, target_parallel_config)

    create_speculative_config._vllm_dflash = True  # type: ignore[attr-defined]
    engine_args.create_speculative_config = create_speculative_config


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs each callback with the module once ``name`` has been executed by the normal
    import."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.callbacks: list[Callable[[ModuleType], None]] = []

    def find_spec(self, fullname, path, target=None):  # noqa: ANN001 - importlib protocol
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)  # let the regular finders locate the module
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_then_call(module: ModuleType) -> None:
            run(module)
            for callback in self.callbacks:
                callback(module)

        spec.loader.exec_module = exec_then_call  # type: ignore[method-assign]
        return spec


def after_import(name: str, callback: Callable[[ModuleType], None]) -> None:
    """``callback(module)`` now if ``name`` is imported, else right after its import.
    Callbacks must be idempotent: a second registration of the same one is not dropped."""
    if name in sys.modules:
        callback(sys.modules[name])
        return
    finders = (f for f in sys.meta_path if isinstance(f, _AfterImport) and f.name == name)
    finder = next(finders, None)
    if finder is None:
        finder = _AfterImport(name)
        sys.meta_path.insert(0, finder)
    if callback not in finder.callbacks:
        finder.callbacks.append(callback)
