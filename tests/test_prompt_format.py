"""The prompt format (chat template, thinking switch) is applied as serving applies it,
named on every sample, carried through training, and checked by `eval`; sample shards in
a directory read as one file with ids unique over all of them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from vllm_dflash.data import prompt_format
from vllm_dflash.data.prompt_format import PromptFormat
from vllm_dflash.data.records import encode_prompt, read_samples
from vllm_dflash.errors import DFlashDataError

# A Qwen3-style template: with thinking off, the assistant turn opens with an empty think
# block, so the target answers without reasoning.
TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>"
    "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}"
    "{% endif %}"
)


def templated_target(target_dir: Path, dest: Path) -> Path:
    """The tiny target with a chat template that has a thinking switch."""
    from transformers import AutoTokenizer

    shutil.copytree(target_dir, dest)
    tok = AutoTokenizer.from_pretrained(str(dest))
    tok.chat_template = TEMPLATE
    tok.save_pretrained(str(dest))
    return dest


@pytest.fixture(scope="module")
def tok(target_dir, tmp_path_factory):
    from transformers import AutoTokenizer

    path = templated_target(target_dir, tmp_path_factory.mktemp("chat") / "target")
    return AutoTokenizer.from_pretrained(str(path))


def test_the_thinking_switch_reaches_the_template(tok):
    rec = {"prompt": "def f():"}
    default, off, on = (encode_prompt(tok, rec, t) for t in (None, False, True))
    assert off != on and default == on  # the template thinks unless told not to
    assert off[: len(on)] == on  # off appends the empty think block
    fmt = prompt_format.of(tok, rec, False)
    assert fmt.enable_thinking is False and len(fmt.chat_template) == 16
    assert prompt_format.of(tok, rec, True) != fmt
    # Token ids are used as they are: no template, whatever the switch.
    ids = {"prompt_token_ids": [5, 6]}
    assert encode_prompt(tok, ids, False) == [5, 6]
    assert prompt_format.of(tok, ids, False) == PromptFormat(None, None)


def _trained_on(tmp_path: Path, *formats: PromptFormat) -> Path:
    draft = tmp_path / "draft"
    draft.mkdir()
    log = {"prompt_formats": [f.to_json() for f in formats], "log": {}}
    (draft / prompt_format.TRAIN_LOG).write_text(json.dumps(log))
    return draft


def test_eval_warns_when_the_format_differs_from_the_training_data(tmp_path):
    off, on = PromptFormat("a" * 16, False), PromptFormat("a" * 16, True)
    draft = _trained_on(tmp_path, off)
    assert prompt_format.mismatch(draft, {off}) is None
    warning = prompt_format.mismatch(draft, {on})
    assert "thinking on" in warning and "trained on chat template" in warning
    assert "thinking off" in warning and "Fix:" in warning
    other = PromptFormat("b" * 16, False)
    assert "chat template bbbbbbbbbbbbbbbb" in prompt_format.mismatch(draft, {other})
    # Unknown training formats (an older log, or none): nothing to compare.
    assert prompt_format.mismatch(tmp_path, {on}) is None


def _sample(i: int, **extra) -> str:
    rec = {"id": f"s{i}", "prompt_token_ids": [3, 4], "response_token_ids": [5, 6, 7]}
    return json.dumps(rec | extra) + "\n"


def test_a_shard_directory_reads_as_one_file(tmp_path):
    shards = tmp_path / "data"
    shards.mkdir()
    (shards / "shard-00000-of-00002.jsonl").write_text(_sample(0) + _sample(2))
    (shards / "shard-00001-of-00002.jsonl").write_text(_sample(1) + _sample(3))
    assert [r.id for r in read_samples(shards)] == ["s0", "s2", "s1", "s3"]
    (shards / "shard-00001-of-00002.jsonl").write_text(_sample(1) + _sample(2))
    with pytest.raises(DFlashDataError, match="shard-00001-of-00002.jsonl line 2: id 's2' is"):
        read_samples(shards)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DFlashDataError, match="without \\*.jsonl"):
        read_samples(empty)


def test_recorded_formats_of_samples():
    off = PromptFormat("a" * 16, False).to_json()
    recs = [{"prompt_format": off}, {"prompt_format": off}, {}]
    assert prompt_format.of_samples(recs) == [off]
