"""`vllm-dflash gen-data` through a real vLLM engine: the target's own greedy responses,
resumed after an interrupted run, settings recorded, bad prompt lines reported."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_dflash.reference.generate import target_generate

pytestmark = pytest.mark.engine
CLI = Path(sys.executable).with_name("vllm-dflash")
TEXTS = ["def add(a, b):", "import os", "x = [1, 2", "class A:", "for i in", "while True"]
MAX = 24


def _gen(target_dir, prompts, out, *more: str) -> subprocess.CompletedProcess:
    args = [str(CLI), "gen-data", "--target", str(target_dir), "--prompts", str(prompts), *more]
    args += ["--out", str(out), "--max-tokens", str(MAX), "--max-model-len", "256"]
    env = os.environ | {"VLLM_CPU_KVCACHE_SPACE": "1"}
    return subprocess.run(args + ["--dtype", "float32"], capture_output=True, text=True, env=env)


def test_gen_data_resumes_and_matches_the_target(target, target_dir, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target_dir)
    eos = tok.eos_token_id
    prompts = tmp_path / "prompts.jsonl"
    lines = [json.dumps({"id": f"p{i}", "prompt": t}) for i, t in enumerate(TEXTS)]
    prompts.write_text("\n".join([lines[0], "{broken", *lines[1:]]) + "\n")
    sampling = {"max_tokens": MAX, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": 0}
    # A previous run finished p0 and was killed while writing p1.
    ids0 = tok(TEXTS[0]).input_ids
    done = {
        "id": "p0",
        "prompt_token_ids": ids0,
        "response_token_ids": target_generate(target, ids0, MAX, stop_token_ids=[eos]).tokens,
        "sampling": sampling,
    }
    out = tmp_path / "samples.jsonl"
    out.write_text(json.dumps(done) + "\n" + '{"id": "p1", "prompt_tok')

    run = _gen(target_dir, prompts, out)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "line 2: not valid JSON" in run.stderr
    assert "6 prompts, 1 already in" in run.stdout
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert recs[0] == done, "finished work is kept as it was"
    assert sorted(r["id"] for r in recs) == [f"p{i}" for i in range(6)]
    for r in recs[1:]:
        i = int(r["id"][1:])
        assert r["prompt_token_ids"] == tok(TEXTS[i]).input_ids
        # The target itself wrote it: vLLM greedy equals the reference target, token for token.
        ref = target_generate(target, r["prompt_token_ids"], MAX, stop_token_ids=[eos])
        assert r["response_token_ids"] == ref.tokens
        assert r["finish_reason"] == ref.stop_reason and r["sampling"] == sampling
        assert r["response"] == tok.decode(ref.tokens, skip_special_tokens=True)

    again = _gen(target_dir, prompts, out)
    assert again.returncode == 0 and "6 prompts, 6 already in" in again.stdout
    assert [json.loads(line) for line in out.read_text().splitlines()] == recs


def test_gen_data_refuses_to_mix_sampling_settings(target_dir, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"id": "a", "prompt": "x"}) + "\n")
    out = tmp_path / "samples.jsonl"
    out.write_text(json.dumps({"id": "a", "sampling": {"temperature": 1.0}}) + "\n")
    run = _gen(target_dir, prompts, out)
    assert run.returncode == 2 and "line 1 was generated with sampling" in run.stderr


def test_gen_data_shards_with_the_thinking_switch_and_training_reads_the_shards(
    target_dir, tmp_path
):
    """Two shard processes, thinking off: every prompt once, formatted as a server with
    chat_template_kwargs {"enable_thinking": false} would; a shard refuses to resume with
    the switch flipped; training reads the directory and records the format, and `eval`
    warns when it evaluates another one."""
    from test_prompt_format import templated_target
    from transformers import AutoTokenizer

    from vllm_dflash.data.records import encode_prompt
    from vllm_dflash.train.config import TrainConfig
    from vllm_dflash.train.trainer import Trainer

    chat = templated_target(target_dir, tmp_path / "chat")
    tok = AutoTokenizer.from_pretrained(str(chat))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(json.dumps({"id": f"p{i}", "prompt": t}) + "\n" for i, t in enumerate(TEXTS))
    )
    out = tmp_path / "shards"
    off = ["--enable-thinking", "false", "--num-shards", "2"]
    for i in range(2):
        run = _gen(chat, prompts, out, *off, "--shard-index", str(i))
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        assert "tokens/s" in run.stdout
    files = sorted(p.name for p in out.iterdir())
    assert files == ["shard-00000-of-00002.jsonl", "shard-00001-of-00002.jsonl"]
    for i, name in enumerate(files):
        recs = [json.loads(line) for line in (out / name).read_text().splitlines()]
        assert [r["id"] for r in recs] == [f"p{j}" for j in range(i, len(TEXTS), 2)]
        for r in recs:
            text = TEXTS[int(r["id"][1:])]
            assert r["prompt_token_ids"] == encode_prompt(tok, {"prompt": text}, False)
            assert r["prompt_format"]["enable_thinking"] is False
    flipped = _gen(chat, prompts, out, "--enable-thinking", "true", "--num-shards", "2")
    assert flipped.returncode == 2 and "generated with enable_thinking False" in flipped.stderr

    cfg = {"target": chat, "data": out, "out": tmp_path / "drafter", "steps": 2}
    cfg |= {"block_size": 4, "num_layers": 1, "batch_size": 2, "eval_num_prompts": 2}
    cfg |= {"eval_every": 0, "save_every": 0, "eval_max_tokens": 8}
    drafter = Trainer(TrainConfig.load(None, cfg)).run()
    log = json.loads((drafter / "train_log.json").read_text())
    assert [f["enable_thinking"] for f in log["prompt_formats"]] == [False]
    args = [str(CLI), "eval", "--target", str(chat), "--draft", str(drafter)]
    args += ["--prompts", str(prompts), "--max-tokens", "8", "--enable-thinking"]
    same = subprocess.run([*args, "false"], capture_output=True, text=True)
    other = subprocess.run([*args, "true"], capture_output=True, text=True)
    assert same.returncode == other.returncode == 0, other.stderr[-2000:]
    assert "warning: prompts here are formatted" not in same.stderr
    assert "warning: prompts here are formatted with chat template" in other.stderr
    assert "thinking on" in other.stderr and "thinking off" in other.stderr


def test_gen_data_runs_several_engines_from_one_command(target, target_dir, tmp_path):
    """--data-parallel-size 2: two engines (one core each here), one shard each, the target's
    own greedy responses for every prompt once; a rerun finds every shard finished."""
    from transformers import AutoTokenizer

    eos = AutoTokenizer.from_pretrained(target_dir).eos_token_id
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(json.dumps({"id": f"p{i}", "prompt": t}) + "\n" for i, t in enumerate(TEXTS))
    )
    out = tmp_path / "dp"
    run = _gen(target_dir, prompts, out, "--data-parallel-size", "2")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "VLLM_CPU_OMP_THREADS_BIND=" in run.stdout  # each engine its own cores
    assert f"2 engines, {len(TEXTS)} of {len(TEXTS)} prompts" in run.stdout
    recs = [
        json.loads(line)
        for i in range(2)
        for line in (out / f"shard-{i:05d}-of-00002.jsonl").open()
    ]
    assert sorted(r["id"] for r in recs) == sorted(f"p{i}" for i in range(len(TEXTS)))
    for r in recs:
        ref = target_generate(target, r["prompt_token_ids"], MAX, stop_token_ids=[eos])
        assert r["response_token_ids"] == ref.tokens
    assert "tokens/s" in (out / "logs" / "shard-1.log").read_text()
    # Each engine's stats count what it wrote, its generation time without its start-up,
    # and the launcher's rate is over the span they generated in together.
    stats = [json.loads((out / "logs" / f"shard-{i}.stats.json").read_text()) for i in range(2)]
    assert sum(s["tokens"] for s in stats) == sum(len(r["response_token_ids"]) for r in recs)
    assert sum(s["prompts"] for s in stats) == len(TEXTS)
    assert all(s["end"] - s["start"] > 0 for s in stats)
    assert "; generating " in run.stdout and "with the engines' start" in run.stdout

    again = _gen(target_dir, prompts, out, "--data-parallel-size", "2")
    assert again.returncode == 0 and "0 new response tokens" in again.stdout
