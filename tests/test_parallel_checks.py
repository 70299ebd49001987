"""Start-up checks of the parallel layout, the per-step hidden-state shape check, and the
benchmark's per-rank core binding (no engine; the engine-level refusals are in
test_serving_bad_config.py)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from vllm_dflash.bench.compare_backends import cpu_binding
from vllm_dflash.config import DrafterConfig
from vllm_dflash.errors import DFlashConfigError
from vllm_dflash.serving.drafter_config import Parallelism, check_parallel
from vllm_dflash.serving.start_checks import check_features


def _drafter(drafter_dirs, **fields) -> DrafterConfig:
    data = json.loads((drafter_dirs[8] / "config.json").read_text()) | fields
    return DrafterConfig.from_dict(data)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "mlp", "tp"),
    [(4, 2, 128, 1), (4, 2, 128, 2), (4, 2, 128, 4), (8, 2, 128, 8), (6, 2, 576, 2)],
)
def test_layouts_that_shard(drafter_dirs, heads, kv_heads, mlp, tp):
    """Fewer key/value heads than ranks is fine when the ranks are a multiple of them
    (vLLM replicates the heads), as for Qwen3-Coder-30B-A3B's drafter at TP=8."""
    draft = _drafter(
        drafter_dirs, num_attention_heads=heads, num_key_value_heads=kv_heads, intermediate_size=mlp
    )
    check_parallel(draft, Parallelism(tensor_parallel_size=tp))
    check_parallel(draft, Parallelism(tensor_parallel_size=tp, draft_tensor_parallel_size=tp))
    # vLLM accepts 1 too; the drafter is sharded all the same (the proposer warns).
    check_parallel(draft, Parallelism(tensor_parallel_size=tp, draft_tensor_parallel_size=1))


@pytest.mark.parametrize(
    ("fields", "parallel", "needles"),
    [
        ({}, Parallelism(4, 1, 2), ["'draft_tensor_parallel_size' = 2", "set it to 4"]),
        ({}, Parallelism(1, 1, 2), ["'draft_tensor_parallel_size' = 2", "set it to 1"]),
        ({}, Parallelism(2, 2), ["'pipeline_parallel_size' = 2", "tensor parallelism only"]),
        ({}, Parallelism(2, 1, None, 2), ["'decode_context_parallel_size' = 2"]),
        ({}, Parallelism(2, 1, None, 1, 2), ["'prefill_context_parallel_size' = 2"]),
        (
            {"num_attention_heads": 6, "num_key_value_heads": 2},
            Parallelism(4),
            ["'num_attention_heads' = 6"],
        ),
        (
            {"num_attention_heads": 6, "num_key_value_heads": 3},
            Parallelism(2),
            ["'num_key_value_heads' = 3"],
        ),
        (
            {"num_attention_heads": 6, "num_key_value_heads": 2},
            Parallelism(3),
            ["'num_key_value_heads' = 2", "is a multiple of it"],
        ),
        ({"intermediate_size": 129}, Parallelism(2), ["'intermediate_size' = 129"]),
    ],
)
def test_unsupported_layouts_are_named(drafter_dirs, fields, parallel, needles):
    with pytest.raises(DFlashConfigError) as e:
        check_parallel(_drafter(drafter_dirs, **fields), parallel)
    for needle in [*needles, "Fix:"]:
        assert needle in str(e.value)


def test_a_slice_of_the_hidden_states_stops_drafting():
    """The shape the proposer checks every step: one full-width row per target token."""
    draft = SimpleNamespace(feature_size=192, target_layer_ids=(1, 4, 7))
    check_features(draft, (10, 192), 10)
    check_features(draft, (16, 192), 10)  # runner V2 pads rows to its CUDA-graph size
    for wrong in ((10, 96), (5, 192)):  # split by width / by token
        with pytest.raises(DFlashConfigError, match="got a shard"):
            check_features(draft, wrong, 10)


def test_cpu_binding_splits_the_cores(monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {4, 5, 6, 7, 0, 1, 2, 3})
    assert cpu_binding(2) == "0,1,2,3|4,5,6,7"
    assert cpu_binding(3) == "0,1|2,3|4,5"
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    assert cpu_binding(2) == "0|1"
    with pytest.raises(DFlashConfigError, match="needs at least 4 cores"):
        cpu_binding(4)
