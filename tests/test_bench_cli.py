"""`vllm-dflash bench`: bad input fails first and clearly; a real run on the tiny models
writes the table, JSON and plot; an engine that cannot load stops the run, named, with no
engine process left behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

CLI = Path(sys.executable).with_name("vllm-dflash")


def _bench(*args: str, timeout: int = 900, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(CLI), "bench", *args], capture_output=True, text=True, timeout=timeout, env=env
    )


def _prompts(tmp_path: Path, lines: list[str]) -> Path:
    p = tmp_path / "prompts.jsonl"
    p.write_text("".join(line + "\n" for line in lines))
    return p


def test_missing_prompt_file(tmp_path):
    out = _bench("--prompts", str(tmp_path / "nope.jsonl"))
    assert out.returncode == 2
    assert "nope.jsonl: file not found" in out.stderr


def test_empty_prompt_set(tmp_path):
    out = _bench("--prompts", str(_prompts(tmp_path, ["", "{not json"])))
    assert out.returncode == 2
    assert "no usable prompt" in out.stderr and "line 2" in out.stderr


def test_bad_arguments_name_the_flag(tmp_path):
    out = _bench("--backends", "dflash,eagle")
    assert out.returncode == 2 and "backend 'eagle': write one of dflash" in out.stderr
    out = _bench("--backends", "none:3")
    assert out.returncode == 2 and "not for none" in out.stderr
    out = _bench("--backends", "dflash:16")
    assert out.returncode == 2 and "dflash:16: the drafter drafts 1..15" in out.stderr
    out = _bench("--sweep-draft-cost", "--sweep-draft-lens", "1,20")
    assert out.returncode == 2 and "--sweep-draft-lens 20: at most --k = 15" in out.stderr
    out = _bench("--concurrency", "0,4")
    assert out.returncode == 2 and "every value must be >= 1" in out.stderr
    out = _bench("--target", str(tmp_path))
    assert out.returncode == 2 and "no config.json there" in out.stderr
    out = _bench("--k", "40")
    assert out.returncode == 2 and "--k 40: the drafter drafts 1..15 tokens" in out.stderr
    out = _bench("--tensor-parallel-size", "0")
    assert out.returncode == 2 and "--tensor-parallel-size 0: need >= 1" in out.stderr
    unbound = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_OMP_THREADS_BIND"}
    out = _bench("--tensor-parallel-size", str(len(os.sched_getaffinity(0)) + 1), env=unbound)
    assert out.returncode == 2 and "cores for one rank each" in out.stderr


def _engine_workers(workdir: Path) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if "vllm_dflash.bench.engine_worker" in cmd and str(workdir) in cmd:
            found.append(p)
    return found


@pytest.mark.engine
def test_bench_runs_on_the_tiny_models(target_dir, drafter_dirs, tmp_path):
    prompts = _prompts(tmp_path, [json.dumps({"prompt": f"def f{i}(x):"}) for i in range(4)])
    work = tmp_path / "work"
    out = _bench(
        *("--target", str(target_dir), "--draft", str(drafter_dirs[8])),
        # Fixed K: the tiny random drafter rarely lands, so the draft policy would (rightly)
        # verify next to nothing, and the acceptance columns would stay empty.
        *("--backends", "dflash-fixed,none", "--concurrency", "1,2", "--prompts", str(prompts)),
        *("--num-prompts", "4", "--max-tokens", "12", "--repeats", "1"),
        *("--json", str(tmp_path / "rows.json"), "--plot", str(tmp_path / "bench.png")),
        *("--workdir", str(work)),
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = json.loads((tmp_path / "rows.json").read_text())
    assert {(r["backend"], r["concurrency"]) for r in rows} == {
        (b, c) for b in ("dflash-fixed", "none") for c in (1, 2)
    }
    for r in rows:
        assert r["matches_none"] and r["tokens_per_s"] > 0
        assert len(r["ttft_ms"]) == 3 and r["ttft_ms"][0] > 0 and r["tpot_ms"][0] > 0
        assert (r["acceptance_length"] is None) == (r["backend"] == "none")
    assert "| dflash-fixed | 1 |" in out.stdout and "TTFT p50 / p90 ms" in out.stdout
    assert (tmp_path / "bench.png").stat().st_size > 10_000
    assert not _engine_workers(work)


@pytest.mark.engine
def test_engine_that_cannot_load_stops_the_run(target_dir, drafter_dirs, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in Path(target_dir).iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    work = tmp_path / "work"
    out = _bench(
        *("--target", str(broken), "--draft", str(drafter_dirs[8])),
        *("--backends", "dflash,none", "--concurrency", "1", "--num-prompts", "2"),
        *("--prompts", str(_prompts(tmp_path, ['{"prompt": "x = 1"}'] * 2))),
        *("--workdir", str(work)),
    )
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    assert "engine failed" in out.stderr and "full log:" in out.stderr
    assert not _engine_workers(work)


@pytest.mark.engine
def test_adaptive_draft_length_stays_lossless(target_dir, drafter_dirs, tmp_path):
    """Adaptive, fixed K = 7 (the block-8 drafter's full block) and fixed 3 in one run
    (``dflash-fixed``: the draft policy would stop drafting for this drafter, which rarely lands):
    every greedy output equals no speculation's, and the adaptive engine really varied
    its draft length (probes at 1, 2, 4 and 7 at the least)."""
    prompts = _prompts(tmp_path, [json.dumps({"prompt": f"def g{i}(y):"}) for i in range(16)])
    out = _bench(
        *("--target", str(target_dir), "--draft", str(drafter_dirs[8])),
        *("--backends", "adaptive,dflash-fixed,dflash-fixed:3,none", "--concurrency", "1,4"),
        *("--prompts", str(prompts), "--num-prompts", "16", "--max-tokens", "24"),
        *("--repeats", "1", "--json", str(tmp_path / "rows.json")),
        *("--workdir", str(tmp_path / "work")),
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = {
        (r["backend"], r["concurrency"]): r
        for r in json.loads((tmp_path / "rows.json").read_text())
    }
    assert all(r["matches_none"] for r in rows.values())
    for c in (1, 4):
        assert rows[("dflash-fixed", c)]["draft_tokens_per_step"] == 7
        assert rows[("dflash-fixed:3", c)]["draft_tokens_per_step"] == 3
        assert 1 < rows[("adaptive", c)]["draft_tokens_per_step"] < 7


@pytest.mark.engine
def test_sweep_draft_cost_measures_and_predicts(target_dir, drafter_dirs, tmp_path):
    out = _bench(
        *("--target", str(target_dir), "--draft", str(drafter_dirs[8])),
        *("--sweep-draft-cost", "--sweep-draft-lens", "1,3,7", "--concurrency", "1,2"),
        *("--prompts", str(_prompts(tmp_path, ['{"prompt": "x = [i for i in"}'] * 4))),
        *("--num-prompts", "4", "--max-tokens", "32", "--repeats", "1"),
        *("--json", str(tmp_path / "sweep.json"), "--plot", str(tmp_path / "sweep.png")),
        *("--workdir", str(tmp_path / "work")),
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = json.loads((tmp_path / "sweep.json").read_text())
    assert {(r["concurrency"], r["draft_len"]) for r in rows} == {
        (c, g) for c in (1, 2) for g in (1, 3, 7)
    }
    for r in rows:
        assert r["matches_none"] and r["measured"] > 0
        assert r["drafter_ms"] > 0 and r["verify_ms"] > 0 and r["plain_ms"] > 0
        assert r["predicted"] > 0 and r["tau"] >= 1
    taus = [r["tau"] for r in rows if r["concurrency"] == 1]
    assert taus == sorted(taus)  # tau grows with draft_len
    assert "controller's choice" in out.stdout
    assert (tmp_path / "sweep.png").stat().st_size > 10_000
    assert not _engine_workers(tmp_path / "work")
