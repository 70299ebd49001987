"""The GPU check kit (vllm_dflash/gpu_check/) in its dry mode, so a broken kit fails here and
not on a rented GPU: the CLI end to end, its comparisons against wrong kernels, the graph
bookkeeping with a CPU stand-in for CUDA graphs, the vLLM probe, and the shape set."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vllm_dflash import ops
from vllm_dflash.config import DrafterConfig, default_target_layer_ids
from vllm_dflash.gpu_check import drafter_timing, engine_probe, ops_check, project
from vllm_dflash.gpu_check.plan import make_plan
from vllm_dflash.gpu_check.report import Report, markdown
from vllm_dflash.gpu_check.results import PartResult
from vllm_dflash.gpu_check.runner import Runner
from vllm_dflash.gpu_check.shapes import QWEN3_8B_B16, TINY

CLI = Path(sys.executable).parent / "vllm-dflash"


def _dry_run(out: Path, argv: list[str]) -> tuple[subprocess.CompletedProcess, dict, str]:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    js, md = out / "gpu-check.json", out / "gpu-check.md"
    assert js.is_file() and md.is_file(), proc.stdout + proc.stderr
    return proc, json.loads(js.read_text()), md.read_text()


def _parts(report: dict) -> dict[str, dict]:
    return {p["key"]: p for p in report["parts"]}


def _checks(part: dict) -> dict[str, dict]:
    return {c["name"]: c for c in part["checks"]}


def test_dry_run_through_the_cli(tmp_path):
    out = tmp_path / "out"
    proc, report, md = _dry_run(out, [str(CLI), "gpu-check", "--dry-run", "--out", str(out)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "[gpu-check" in proc.stdout  # progress lines
    assert report["mode"] == "dry-run" and report["exit_code"] == 0
    assert report["vllm_in_process"] is False  # only part (c)'s subprocesses import vLLM
    assert (
        report["extension"]["imported"] and "CPU" in report["extension"]["kernels"]["qk_norm_rope"]
    )
    parts = _parts(report)
    assert set(parts) == {"a", "b", "c"}
    assert all(p["status"] in ("ok", "failed", "skipped") for p in parts.values())
    for p in parts.values():
        assert all(c["status"] in ("ok", "failed", "skipped") for c in p["checks"])

    # (a): every op and dtype compared the CPU kernel with the reference; graphs skipped.
    a = _checks(parts["a"])
    assert parts["a"]["status"] == "ok"
    for op in ("inject_context_kv", "qk_norm_rope"):
        for dtype in ("bfloat16", "float16"):
            eager = a[f"{op} {dtype} eager vs reference"]
            assert eager["status"] == "ok", eager
            assert eager["metrics"]["max_abs_err"] >= 0
            assert eager["metrics"]["worst_tolerance_fraction"] <= 1
            assert a[f"{op} {dtype} CUDA graph replay vs reference"]["status"] == "skipped"
            assert a[f"{op} {dtype} timing"]["metrics"]["kernel_eager_us"] > 0
    assert a["inject_context_kv bfloat16 eager vs reference"]["metrics"]["padding_rows"] == 4

    # (b): one eager row per (B, draft_len) of the tiny set, graph columns skipped.
    assert parts["b"]["status"] == "ok"
    (table,) = parts["b"]["tables"]
    assert [(r[0], r[1]) for r in table["rows"]] == [(1, 1), (1, 2), (2, 1), (2, 2)]
    assert all(float(r[2]) > 0 and r[3].startswith("skipped") for r in table["rows"])

    # (c): vLLM is importable here, its version recorded, no engine started.
    c = _checks(parts["c"])
    assert c["probe: import vllm"]["status"] == "ok"
    assert parts["c"]["info"]["vllm_version"]
    assert c["engine comparison (ours vs builtin vs none)"]["status"] == "skipped"

    assert "| op | dtype |" in md and "| B | draft_len | eager ms |" in md
    assert "## (a)" in md and "## (b)" in md and "## (c)" in md


# ---- part (a)'s comparisons must fail on a wrong kernel ----------------------------------


@pytest.fixture(scope="module")
def reference():
    assert ops.load(), "vllm_dflash._C did not load: run `make install`"
    from vllm_dflash.ops import reference as ops_reference

    return ops_reference


def _inject_case(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return ops_check.make_inject_case(TINY, torch.bfloat16, torch.device("cpu"), gen)


def _qk_case(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return ops_check.make_qk_case(TINY, torch.bfloat16, torch.device("cpu"), gen)


def test_inject_comparison_passes_the_kernel(reference):
    comp = ops_check.compare_inject(
        torch.ops.vllm_dflash.inject_context_kv, _inject_case(), reference.inject_context_kv
    )
    assert comp.ok, comp.mismatches
    assert comp.rows_written == TINY.context_rows - 4 and comp.padding_rows == 4


def test_inject_comparison_names_a_wrong_value(reference):
    def wrong(*args):
        torch.ops.vllm_dflash.inject_context_kv(*args)
        slots, values = args[6], args[8]
        s = int(slots[slots >= 0][0])
        values[1][s // TINY.block_size, s % TINY.block_size, 0, 3] += 1  # one value, layer 1

    part = PartResult("a", "test")
    case = _inject_case()
    check = Runner(60).check(
        part,
        "wrong kernel",
        lambda: ops_check.compare_inject(wrong, case, reference.inject_context_kv).outcome(),
    )
    assert check.status == "failed"
    assert "layer 1 value cache: 1 element(s) differ" in check.detail
    assert check.metrics["mismatches"]


def test_inject_comparison_names_writes_outside_the_slots(reference):
    def writes_padding(*args):
        torch.ops.vllm_dflash.inject_context_kv(*args)
        keys, slots = args[7], args[6]
        free = sorted(set(range(keys[0].shape[0] * TINY.block_size)) - set(slots.tolist()))
        bs = TINY.block_size
        keys[0][free[0] // bs, free[0] % bs] += 1  # a row no slot names

    comp = ops_check.compare_inject(writes_padding, _inject_case(), reference.inject_context_kv)
    assert any(
        "layer 0 key cache: 1 row(s) outside the batch's slots" in m for m in comp.mismatches
    )


def test_inject_comparison_names_keys_beyond_tolerance(reference):
    def off_by_far(*args):
        torch.ops.vllm_dflash.inject_context_kv(*args)
        slots, keys = args[6], args[7]
        s = int(slots[0])
        keys[0][s // TINY.block_size, s % TINY.block_size, 1, 0] += 2.0

    comp = ops_check.compare_inject(off_by_far, _inject_case(), reference.inject_context_kv)
    assert [m for m in comp.mismatches if m.startswith("layer 0 key cache: 1 element(s) beyond")]


def test_qk_comparison_names_a_wrong_query_and_touched_values(reference):
    def wrong(qkv, *rest):
        torch.ops.vllm_dflash.qk_norm_rope(qkv, *rest)
        qkv[3, 5] += 1.0  # a query element
        qkv[0, -1] += 1.0  # a value element

    case = _qk_case()
    assert ops_check.compare_qk(torch.ops.vllm_dflash.qk_norm_rope, case, reference.qk_norm_rope).ok
    comp = ops_check.compare_qk(wrong, _qk_case(), reference.qk_norm_rope)
    assert any(m.startswith("query heads: 1 element(s) beyond tolerance") for m in comp.mismatches)
    assert any(m.startswith("value heads: 1 element(s) differ") for m in comp.mismatches)


# ---- the graph paths, with a CPU stand-in for torch.cuda.CUDAGraph ------------------------


class FakeGraph:
    """Replays the captured function on the same (static) buffers, and copies its result into
    the output returned at capture, as a CUDA graph replay updates its static outputs."""

    def __init__(self, fn, run: bool = True):
        self.fn, self.run = fn, run
        self.out = fn()

    def replay(self):
        if self.run:
            new = self.fn()
            if isinstance(new, torch.Tensor):
                self.out.copy_(new)


def _graph_plan():
    return dataclasses.replace(make_plan(True), graphs=True, op_reps=2, step_reps=2)


def test_graph_paths_with_a_stand_in_graph(monkeypatch):
    def capture(fn, warmup=3):
        g = FakeGraph(fn)
        return g, g.out

    monkeypatch.setattr(ops_check, "capture_graph", capture)
    monkeypatch.setattr(drafter_timing, "capture_graph", capture)
    plan, runner, parts = _graph_plan(), Runner(300), []
    ext = project.load_extension()
    a = runner.part("a", "ops", lambda p: ops_check.run(p, runner, plan, ext), parts)
    b = runner.part("b", "drafter", lambda p: drafter_timing.run(p, runner, plan), parts)
    assert a.status == "ok" and b.status == "ok", (a.reason, b.reason)
    graph_checks = [c for c in a.checks if "graph" in c.name]
    assert len(graph_checks) == 4 and all(c.status == "ok" for c in graph_checks)
    assert all(row[4] != "n/a" for row in a.tables[0].rows)  # graph replay timed
    assert all(r[5] == "100%" and r[4].endswith("x") for r in b.tables[0].rows)
    md = markdown(Report("dry-run", "now", {}, dataclasses.asdict(ext), {}, parts, 1.0, 0))
    assert "CUDA graph replay" in md


def test_a_graph_that_does_not_replay_fails(monkeypatch, reference):
    """A replay that leaves the buffers alone must not pass as the kernel."""

    def capture(fn, warmup=3):
        g = FakeGraph(fn, run=False)
        return g, g.out

    monkeypatch.setattr(ops_check, "capture_graph", capture)
    plan, runner, parts = _graph_plan(), Runner(300), []
    ext = project.load_extension()
    a = runner.part("a", "ops", lambda p: ops_check.run(p, runner, plan, ext), parts)
    assert a.status == "failed"
    failed = [c for c in a.checks if c.status == "failed"]
    assert {c.name.split(" CUDA")[0] for c in failed} == {
        f"{op} {dtype}"
        for op in ("inject_context_kv", "qk_norm_rope")
        for dtype in ("bfloat16", "float16")
    }
    assert all("CUDA graph replay" in c.name for c in failed)


def test_missing_cuda_kernel_fails_part_a_with_the_reason():
    plan = dataclasses.replace(make_plan(True), graphs=False)
    ext = project.Extension(True, None, "x.so", kernels={op: ["CPU"] for op in project.OPS})
    cuda_plan = dataclasses.replace(plan, device=torch.device("cuda"))
    assert not ext.has_kernels(cuda_plan.device)
    assert "no CUDA kernel (kernels: CPU)" in ext.missing_reason(cuda_plan.device)
    missing = project.Extension(False, "ImportError: nope", None, kernels={})
    assert "did not import (ImportError: nope)" in missing.missing_reason(plan.device)


# ---- part (c) ------------------------------------------------------------------------------


def test_probe_records_each_failing_step(tmp_path):
    """A vLLM checkout whose package imports but whose compiled ops and GPU runner do not."""
    pkg = tmp_path / "vllm"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("__version__ = '0.0.fake'\n")
    (pkg / "_C.py").write_text("raise ImportError('libcuda.so.1: cannot open shared object')\n")
    plan = dataclasses.replace(make_plan(False, vllm_sources=tmp_path), probe_timeout_s=30)
    runner, parts = Runner(300), []
    c = runner.part("c", "engine", lambda p: engine_probe.run(p, runner, plan, tmp_path), parts)
    checks = {ch.name: ch for ch in c.checks}
    assert checks["probe: import vllm"].status == "ok"
    assert c.info["vllm_version"] == "0.0.fake"
    assert (
        "No module named 'vllm.v1'"
        in checks["probe: import vllm.v1.worker.gpu.model_runner"].detail
    )
    assert "libcuda.so.1" in checks["probe: import vllm._C"].detail
    assert "cannot import name 'LLM'" in checks["probe: from vllm import LLM"].detail
    engine = checks["engine comparison (ours vs builtin vs none)"]
    assert engine.status == "skipped" and "not run on this machine" in engine.detail
    assert c.status == "skipped" and "import vllm.v1.worker.gpu.model_runner" in c.reason


def test_probe_times_out():
    r = engine_probe.probe("sleep", "import time; time.sleep(30)", None, timeout=1)
    assert not r.ok and r.error == "timed out after 1 s"


# ---- shapes ---------------------------------------------------------------------------------


def test_qwen3_8b_b16_shape_set_is_consistent():
    s = QWEN3_8B_B16
    assert s.problems() == []
    assert s.num_attention_heads % s.num_key_value_heads == 0
    assert s.num_attention_heads * s.head_dim == s.hidden_size
    assert s.feature_size == 5 * 4096 and s.num_speculative_tokens == 15 == max(s.draft_lens)
    assert s.context_rows == 32 * 16 and s.qkv_width == (32 + 2 * 8) * 128
    # The project's own validation agrees, and the layers are the public checkpoint's rule.
    cfg = DrafterConfig.from_dict(s.drafter_config_dict())
    assert cfg.feature_size == s.feature_size
    assert cfg.target_layer_ids == default_target_layer_ids(36, 5) == list(s.target_layer_ids)
    assert cfg.num_speculative_tokens == s.num_speculative_tokens


@pytest.mark.parametrize("shapes", [QWEN3_8B_B16, TINY], ids=lambda s: s.name)
def test_shape_sets_are_valid_drafter_configs(shapes):
    assert shapes.problems() == []
    cfg = project.drafter_config(shapes)
    assert cfg.num_hidden_layers == shapes.num_drafter_layers
    assert cfg.feature_size == shapes.feature_size


def test_shape_set_reports_contradictions():
    bad = dataclasses.replace(QWEN3_8B_B16, num_key_value_heads=7, draft_lens=(16,), head_dim=96)
    problems = " ".join(bad.problems())
    assert "not a multiple of num_key_value_heads=7" in problems
    assert "!= hidden_size=4096" in problems
    assert "draft_lens=(16,)" in problems
