"""How prompts became token ids: the chat template applied (if any) and the thinking switch.

A drafter learns the target's responses to prompts formatted one way. Served with another
template, or with thinking on where the data had it off, the responses it must predict
change and acceptance drops, with nothing to say why. So ``gen-data`` records the format
on every sample line, training carries it into its log, and ``eval`` warns when the format
it evaluates differs from the one the drafter was trained on.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from functools import cache
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class PromptFormat:
    # The first 16 hex digits of the applied chat template's sha256; None: no template (raw
    # text for a base model, or prompt token ids given as they are).
    chat_template: str | None
    # The value given to the template's thinking switch; None: the template's own default.
    enable_thinking: bool | None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> PromptFormat:
        return cls(d.get("chat_template"), d.get("enable_thinking"))

    def describe(self) -> str:
        if self.chat_template is None:
            return "no chat template"
        thinking = {None: "its default", True: "on", False: "off"}[self.enable_thinking]
        return f"chat template {self.chat_template}, thinking {thinking}"


def template_kwargs(enable_thinking: bool | None) -> dict[str, Any]:
    """Extra variables for ``apply_chat_template``, as a server passes them in
    ``chat_template_kwargs``."""
    return {} if enable_thinking is None else {"enable_thinking": enable_thinking}


def of(tokenizer: Any, record: dict[str, Any], enable_thinking: bool | None) -> PromptFormat:
    """The format ``encode_prompt`` gives ``record`` with this tokenizer."""
    template = getattr(tokenizer, "chat_template", None)
    if "prompt_token_ids" in record or not template:
        return PromptFormat(None, None)
    if not isinstance(template, str):  # several named templates: the default one applies
        template = template.get("default", next(iter(template.values())))
    return PromptFormat(_digest(template), enable_thinking)


@cache  # gen-data asks once per prompt; a template is hashed once per run
def _digest(template: str) -> str:
    return hashlib.sha256(template.encode("utf-8")).hexdigest()[:16]


TRAIN_LOG = "train_log.json"  # written by the trainer next to its export


def trained_on(draft_dir: Path) -> set[PromptFormat] | None:
    """The prompt formats of a drafter's training data, from its training log; None where
    unknown (no log, or data written before formats were recorded)."""
    log = draft_dir / TRAIN_LOG
    if not log.is_file():
        return None
    formats = json.loads(log.read_text()).get("prompt_formats")
    return None if not formats else {PromptFormat.from_json(f) for f in formats}


def mismatch(draft_dir: Path, evaluated: Iterable[PromptFormat]) -> str | None:
    """A warning when prompts are formatted in a way the drafter never saw in training."""
    trained = trained_on(draft_dir)
    if trained is None:
        return None
    unseen = sorted((f for f in set(evaluated) if f not in trained), key=PromptFormat.describe)
    if not unseen:
        return None
    return (
        f"prompts here are formatted with {'; '.join(f.describe() for f in unseen)}, but "
        f"{draft_dir} was trained on {'; '.join(sorted(f.describe() for f in trained))}. "
        "Acceptance drops where the target's responses differ with the format. Fix: the "
        "--enable-thinking (and chat template) the data was generated with, or regenerate "
        "the data the way you serve"
    )


def of_samples(records: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The distinct recorded formats of sample records (gen-data lines), as JSON."""
    seen = {PromptFormat.from_json(r["prompt_format"]) for r in records if "prompt_format" in r}
    return [f.to_json() for f in sorted(seen, key=PromptFormat.describe)]
