"""Prompt and sample files: bad lines reported by number, skipped or refused; encoding."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from vllm_dflash.data.records import encode_prompt, read_prompts, read_samples
from vllm_dflash.errors import DFlashDataError

LINES = [
    json.dumps({"id": "a", "prompt": "def f():"}),
    "",
    "{not json",
    json.dumps({"prompt": ""}),
    json.dumps([1, 2]),
    json.dumps({"messages": [{"role": "user", "content": "hi"}]}),
    json.dumps({"prompt_token_ids": [5, 6]}),
]


def test_bad_prompt_lines_are_reported_and_skipped(tmp_path, capsys):
    f = tmp_path / "p.jsonl"
    f.write_text("\n".join(LINES) + "\n")
    recs = read_prompts(f)
    assert [r.line for r in recs] == [1, 6, 7]
    err = capsys.readouterr().err
    assert "skipping 4 bad line(s)" in err
    for n, what in [(2, "empty line"), (3, "not valid JSON"), (4, '"prompt"'), (5, "object")]:
        assert f"line {n}: " in err and what in err
    assert recs[0].id == "a" and len({r.id for r in recs}) == 3


def test_strict_refuses_the_file_naming_every_bad_line(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text("\n".join(LINES) + "\n")
    with pytest.raises(DFlashDataError) as e:
        read_prompts(f, strict=True)
    msg = str(e.value)
    assert all(f"line {n}:" in msg for n in (2, 3, 4, 5)) and "Fix:" in msg


def test_samples_need_token_ids_and_a_response(tmp_path):
    f = tmp_path / "s.jsonl"
    good = {"id": 1, "prompt_token_ids": [1, 2], "response_token_ids": [3]}
    f.write_text(
        json.dumps(good)
        + "\n"
        + json.dumps(good | {"response_token_ids": []})
        + "\n"
        + json.dumps({"prompt": "x"})
        + "\n"
    )
    with pytest.raises(DFlashDataError, match=r"line 2: .*empty.*\n.*line 3: .*gen-data"):
        read_samples(f, strict=True)
    assert len(read_samples(f)) == 1


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("response_token_ids", [3, True], r'"response_token_ids"\[1\] = true: not a token id'),
        ("prompt_token_ids", [-1, 2], r'"prompt_token_ids"\[0\] = -1: .*not negative'),
        ("response_token_ids", [3, 2.0], r'"response_token_ids"\[1\] = 2.0: not a token id'),
        ("response_token_ids", [3, 100], r".*\[1\] = 100: outside the target's vocabulary of 64"),
    ],
)
def test_sample_token_ids_are_checked_with_their_line(tmp_path, field, value, message):
    f = tmp_path / "s.jsonl"
    good = {"prompt_token_ids": [1, 2], "response_token_ids": [3]}
    lines = [good | {"id": "a"}, good | {"id": "b", field: value}]
    f.write_text("".join(json.dumps(x) + "\n" for x in lines))
    with pytest.raises(DFlashDataError, match="line 2: " + message):
        read_samples(f, strict=True, vocab_size=64)
    assert [r.id for r in read_samples(f, vocab_size=64)] == ["a"]  # skipped without strict


def test_prompt_token_ids_are_checked_against_the_vocabulary(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"prompt_token_ids": [5, 64]}) + "\n")
    with pytest.raises(DFlashDataError, match=r"line 1: .*vocabulary of 64"):
        read_prompts(f, strict=True, vocab_size=64)
    assert len(read_prompts(f, vocab_size=65)) == 1


def test_repeated_sample_ids_are_refused_even_without_strict(tmp_path):
    f = tmp_path / "s.jsonl"
    rec = {"prompt_token_ids": [1, 2], "response_token_ids": [3]}
    ids = ["a", "b", "a", "c", "b"]
    f.write_text("".join(json.dumps(rec | {"id": i}) + "\n" for i in ids))
    with pytest.raises(DFlashDataError, match=r"2 repeated.*\n.*line 3: id 'a' is already line 1"):
        read_samples(f)


def test_missing_and_useless_files(tmp_path):
    with pytest.raises(DFlashDataError, match="not found"):
        read_prompts(tmp_path / "nope.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(DFlashDataError, match="no usable prompts"):
        read_prompts(tmp_path / "empty.jsonl")


def test_encode_prompt_uses_the_chat_template_when_there_is_one(target_dir, tmp_path):
    tok = AutoTokenizer.from_pretrained(target_dir)
    assert encode_prompt(tok, {"prompt": "abc"}) == tok("abc").input_ids
    assert encode_prompt(tok, {"prompt_token_ids": [7, 8]}) == [7, 8]
    with pytest.raises(DFlashDataError, match="no chat template"):
        encode_prompt(tok, {"messages": [{"role": "user", "content": "a"}]})
    tok.chat_template = "{% for m in messages %}<{{ m.content }}>{% endfor %}"
    assert encode_prompt(tok, {"prompt": "abc"}) == tok("<abc>").input_ids
    msgs = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    assert encode_prompt(tok, {"messages": msgs}) == tok("<a><b>").input_ids
