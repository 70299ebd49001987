"""Our ``VLLM_DFLASH_*`` variables in vLLM's own list of environment variables.

vLLM checks every ``VLLM_*`` variable of the process against ``vllm.envs`` when it builds
an engine configuration: an unknown one is a warning, and with
``--fail-on-environ-validation`` an error that stops the start. Ours share the prefix, so
the plugin adds them to that list in every process, whether it serves or stands aside
(``VLLM_DFLASH_BACKEND=builtin`` is ours too). It is the one change the plugin leaves in
place when it stands aside; a misspelt ``VLLM_DFLASH_*`` name stays unknown, so vLLM still
reports it. The getters return the raw value, as vLLM's own do: vLLM hashes every known
variable into its compile-cache key, and a setting such as ``VLLM_DFLASH_CUSTOM_OPS``
changes the drafter's graph.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from vllm_dflash.serving.seams import resolve


def register(names: Iterable[str]) -> None:
    known = resolve("vllm_envs")
    for name in names:
        if name not in known:
            known[name] = lambda name=name: os.environ.get(name)
