"""JSONL prompt and sample files: parsing with line numbers, ids, and prompt encoding.

Prompt files hold one object per line with ``"prompt"`` (text), ``"messages"`` (a chat,
list of {"role", "content"}) or ``"prompt_token_ids"``, and optionally ``"id"``. Sample
files (written by ``gen-data``) hold ``prompt_token_ids`` and ``response_token_ids``. A bad
line is reported with its number; by default it is skipped, with ``strict=True`` the whole
file is refused.
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_dflash.errors import DFlashDataError


@dataclass
class Record:
    line: int
    data: dict[str, Any]

    @property
    def id(self) -> str:
        if "id" in self.data:
            return str(self.data["id"])
        body = [self.data.get(k) for k in ("messages", "prompt", "prompt_token_ids")]
        return hashlib.sha1(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]


def _check_prompt(d: dict[str, Any]) -> str | None:
    if isinstance(d.get("prompt"), str) and d["prompt"]:
        return None
    ids = d.get("prompt_token_ids")
    if isinstance(ids, list) and ids and all(isinstance(i, int) for i in ids):
        return None  # already tokenized
    msgs = d.get("messages")
    if (
        isinstance(msgs, list)
        and msgs
        and all(
            isinstance(m, dict) and isinstance(m.get("content"), str) and "role" in m for m in msgs
        )
    ):
        return None
    return (
        'needs a non-empty "prompt" string, a "messages" list of {"role", "content"}, or '
        '"prompt_token_ids"'
    )


def _check_sample(d: dict[str, Any]) -> str | None:
    for key in ("prompt_token_ids", "response_token_ids"):
        ids = d.get(key)
        if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
            return f'needs "{key}" as a list of token ids (write the file with gen-data)'
    if not d["prompt_token_ids"]:
        return '"prompt_token_ids" is empty'
    if not d["response_token_ids"]:
        return '"response_token_ids" is empty: nothing to train on'
    return None


def read_jsonl(
    path: str | Path,
    check: Callable[[dict[str, Any]], str | None],
    *,
    strict: bool = False,
    what: str = "record",
) -> list[Record]:
    """Parse ``path``; lines failing JSON or ``check`` are reported with their numbers."""
    path = Path(path)
    if not path.is_file():
        raise DFlashDataError(f"{path}: file not found. Fix: check the path")
    good: list[Record] = []
    bad: list[str] = []
    with path.open(encoding="utf-8") as f:
        for n, raw in enumerate(f, start=1):
            text = raw.strip()
            if not text:
                bad.append(f"line {n}: empty line")
                continue
            try:
                data = json.loads(text)
            except json.JSONDecodeError as e:
                bad.append(f"line {n}: not valid JSON ({e.msg}, column {e.colno})")
                continue
            problem = "not a JSON object" if not isinstance(data, dict) else check(data)
            if problem:
                bad.append(f"line {n}: {problem}")
                continue
            good.append(Record(n, data))
    if bad:
        shown = "\n  ".join(bad[:20]) + (
            f"\n  ... and {len(bad) - 20} more" if len(bad) > 20 else ""
        )
        if strict:
            raise DFlashDataError(
                f"{path}: {len(bad)} bad line(s):\n  {shown}\n"
                "Fix: repair those lines, or drop --strict to skip them"
            )
        print(f"warning: {path}: skipping {len(bad)} bad line(s):\n  {shown}", file=sys.stderr)
    if not good:
        raise DFlashDataError(f"{path}: no usable {what}s. Fix: check the file's format")
    return good


def read_prompts(path: str | Path, *, strict: bool = False) -> list[Record]:
    return read_jsonl(path, _check_prompt, strict=strict, what="prompt")


def read_samples(path: str | Path, *, strict: bool = False) -> list[Record]:
    return read_jsonl(path, _check_sample, strict=strict, what="sample")


def encode_prompt(tokenizer: Any, record: dict[str, Any]) -> list[int]:
    """Token ids the target sees: its chat template when it has one, else the raw text.

    A plain ``"prompt"`` becomes a one-turn user chat for chat models; a base model (no
    template, e.g. the embedded code model) continues the text as is."""
    if "prompt_token_ids" in record:
        return list(record["prompt_token_ids"])
    if getattr(tokenizer, "chat_template", None):
        msgs = record.get("messages") or [{"role": "user", "content": record["prompt"]}]
        out = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        if isinstance(out, dict) or hasattr(out, "input_ids"):  # transformers 5 BatchEncoding
            out = out["input_ids"]
        return list(out)
    if "messages" in record:
        raise DFlashDataError(
            f'record {record.get("id", "")!r} has "messages" but the target tokenizer has no '
            'chat template. Fix: give a "prompt" string instead'
        )
    return list(tokenizer(record["prompt"]).input_ids)
