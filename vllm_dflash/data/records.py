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


def _ids_problem(key: str, ids: Any, vocab_size: int | None) -> str | None:
    """What is wrong with ``ids`` as the token ids of field ``key``, if anything."""
    if not isinstance(ids, list):
        return f'needs "{key}" as a list of token ids'
    for i, t in enumerate(ids):
        # bool is an int in Python, and JSON's true would silently become token 1
        if isinstance(t, bool) or not isinstance(t, int):
            return f'"{key}"[{i}] = {json.dumps(t)}: not a token id'
        if t < 0:
            return f'"{key}"[{i}] = {t}: token ids are not negative'
        if vocab_size is not None and t >= vocab_size:
            return f'"{key}"[{i}] = {t}: outside the target\'s vocabulary of {vocab_size}'
    return None


def _check_prompt(d: dict[str, Any], vocab_size: int | None = None) -> str | None:
    if isinstance(d.get("prompt"), str) and d["prompt"]:
        return None
    ids = d.get("prompt_token_ids")
    if isinstance(ids, list) and ids:
        return _ids_problem("prompt_token_ids", ids, vocab_size)  # already tokenized
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


def _check_sample(d: dict[str, Any], vocab_size: int | None = None) -> str | None:
    for key in ("prompt_token_ids", "response_token_ids"):
        problem = _ids_problem(key, d.get(key), vocab_size)
        if problem:
            return f"{problem} (write the file with gen-data)"
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


def read_prompts(
    path: str | Path, *, strict: bool = False, vocab_size: int | None = None
) -> list[Record]:
    """Prompt records; given the target's ``vocab_size``, token ids are checked against it."""
    return read_jsonl(path, lambda d: _check_prompt(d, vocab_size), strict=strict, what="prompt")


def sample_files(path: str | Path) -> list[Path]:
    """``path`` itself, or the ``*.jsonl`` shards in it when it is a directory (``gen-data
    --num-shards``), in name order."""
    path = Path(path)
    if not path.is_dir():
        return [path]
    files = sorted(path.glob("*.jsonl"))
    if not files:
        raise DFlashDataError(f"{path}: a directory without *.jsonl sample files")
    return files


def read_samples(
    path: str | Path, *, strict: bool = False, vocab_size: int | None = None
) -> list[Record]:
    """Sample records from a file or a directory of shards. Ids must be unique over all of
    them, whatever ``strict`` says: offline features are looked up by id, so a repeated id
    would train one sample on another's features."""
    files = sample_files(path)
    records, where = [], []
    for f in files:
        got = read_jsonl(f, lambda d: _check_sample(d, vocab_size), strict=strict, what="sample")
        records += got
        where += [f"line {r.line}" if len(files) == 1 else f"{f.name} line {r.line}" for r in got]
    first: dict[str, str] = {}
    repeated = []
    for r, at in zip(records, where, strict=True):
        if r.id in first:
            repeated.append(f"{at}: id {r.id!r} is already {first[r.id]}'s")
        first.setdefault(r.id, at)
    if repeated:
        shown = "\n  ".join(repeated[:20])
        raise DFlashDataError(
            f"{path}: {len(repeated)} repeated sample id(s):\n  {shown}\n"
            'Fix: give every sample its own "id" (gen-data writes unique ones)'
        )
    return records


def encode_prompt(
    tokenizer: Any, record: dict[str, Any], enable_thinking: bool | None = None
) -> list[int]:
    """Token ids the target sees: its chat template when it has one, else the raw text.

    A plain ``"prompt"`` becomes a one-turn user chat for chat models; a base model (no
    template, e.g. the embedded code model) continues the text as is. ``enable_thinking``
    goes to the template as a server's ``chat_template_kwargs`` would (None: the template's
    default); ``prompt_format.of`` names the result."""
    from vllm_dflash.data.prompt_format import template_kwargs

    if "prompt_token_ids" in record:
        return list(record["prompt_token_ids"])
    if getattr(tokenizer, "chat_template", None):
        msgs = record.get("messages") or [{"role": "user", "content": record["prompt"]}]
        out = tokenizer.apply_chat_template(
            msgs, add_generation_prompt=True, tokenize=True, **template_kwargs(enable_thinking)
        )
        if isinstance(out, dict) or hasattr(out, "input_ids"):  # transformers 5 BatchEncoding
            out = out["input_ids"]
        return list(out)
    if "messages" in record:
        raise DFlashDataError(
            f'record {record.get("id", "")!r} has "messages" but the target tokenizer has no '
            'chat template. Fix: give a "prompt" string instead'
        )
    return list(tokenizer(record["prompt"]).input_ids)
