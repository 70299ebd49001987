"""vLLM 0.34's seam for custom runner-V2 speculators: a draft model class declares a
``speculator_config_class`` (vLLM's ``SpeculativeDraftModel`` protocol), and for method
``dflash`` vLLM builds the ``speculator_class`` that config names. Ours subclasses vLLM's
DFlash config, so setup and behaviour stay vLLM's and only the class it builds changes.

Like vLLM's own speculator configs, this module is imported in every process and must not
import the speculator.
"""

from __future__ import annotations

from vllm_dflash.serving.seams import resolve

SPECULATOR = "vllm_dflash.serving.v2.speculator.DFlashSpeculator"

try:  # vLLM 0.34+ (seam v2.speculator_config)
    _VllmDFlashConfig = resolve("v2.speculator_config")
except (ImportError, AttributeError):  # earlier: install.py wires the speculator in
    _VllmDFlashConfig = None

if _VllmDFlashConfig is not None:

    class DFlashSpeculatorConfig(_VllmDFlashConfig):
        speculator_class = SPECULATOR


def speculator_config_class() -> type | None:
    """The config our drafter class declares, or None where vLLM has no such seam."""
    return None if _VllmDFlashConfig is None else DFlashSpeculatorConfig
