"""Adversarial drafters for ``vllm-dflash bench --drafts always|never``, built from any target.

The drafter (ours or vLLM's built-in) runs as usual, so every step costs what it costs;
only its tokens are replaced, in the engine core's scheduler as they arrive
(``Scheduler.update_draft_token_ids``), before anything verifies them:

* ``always``: the target's own greedy continuation at those positions, so every draft is
  accepted (acceptance length K + 1, the ceiling);
* ``never``: a token that differs from it, so none is.

The continuation comes from the bench's no-speculation pass over the same prompts
(``VLLM_DFLASH_BENCH_ORACLE``: a JSON list of [prompt token ids, output token ids]). It
holds for greedy requests, which are what the bench sends. Installed whatever the plugin
decided (``activate.py``), so vLLM's built-in gets the same drafts; with async scheduling
drafts stay on the device and are not replaced (a GPU bench of this kind would need the
replacement on the device).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from vllm_dflash.env_settings import EnvSettings
from vllm_dflash.errors import DFlashConfigError
from vllm_dflash.serving.seams import patch

logger = logging.getLogger("vllm.plugins.vllm_dflash")


class BenchDraftSettings(EnvSettings):
    bench_drafts: Literal["drafter", "always", "never"] = Field(
        "drafter", description='"drafter", "always" or "never" (a benchmark setting)'
    )
    bench_oracle: str = Field("", description="the bench's JSON of greedy continuations")


def install_if_asked() -> None:
    s = BenchDraftSettings.from_env()
    if s.bench_drafts == "drafter":
        return
    path = Path(s.bench_oracle)
    if not path.is_file():
        raise DFlashConfigError(
            f"VLLM_DFLASH_BENCH_DRAFTS={s.bench_drafts} needs VLLM_DFLASH_BENCH_ORACLE, the "
            f"file of greedy continuations; {str(path)!r} is not a file. Fix: run it through "
            "vllm-dflash bench --drafts, which writes it"
        )
    oracle = {tuple(p): list(o) for p, o in json.loads(path.read_text())}
    logger.warning(
        "vllm-dflash: benchmark drafts: every draft is replaced by one that is %s accepted",
        s.bench_drafts,
    )
    patch.wrap(
        "scheduler",
        lambda update: _replacing(update, oracle, s.bench_drafts),
        member="update_draft_token_ids",
    )


def replaced(continuation: list[int], start: int, n: int, mode: str) -> list[int]:
    """The ``n`` drafts after the first ``start`` output tokens."""
    out = []
    for j in range(start, start + n):
        t = continuation[j] if j < len(continuation) else 0
        out.append(t if mode == "always" else (t - 1 if t > 0 else 1))
    return out


def _replacing(update, oracle: dict[tuple[int, ...], list[int]], mode: str):
    # Each request's continuation, found once: hashing its prompt every step would charge
    # the speculating engines a cost that the plain engine of the same bench does not pay.
    found: dict[str, list[int] | None] = {}

    def update_draft_token_ids(self, draft_token_ids: Any) -> None:
        for rid, drafts in zip(
            draft_token_ids.req_ids, draft_token_ids.draft_token_ids, strict=True
        ):
            r = self.requests.get(rid)
            if not drafts or r is None:
                continue
            if rid not in found:
                for gone in [g for g in found if g not in self.requests]:
                    del found[gone]
                found[rid] = oracle.get(tuple(r.prompt_token_ids))
            cont = found[rid]
            if cont is not None:
                drafts[:] = replaced(cont, len(r.output_token_ids), len(drafts), mode)
        return update(self, draft_token_ids)

    return update_draft_token_ids
