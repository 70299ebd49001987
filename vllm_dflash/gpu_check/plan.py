"""What one run of the kit does: the GPU plan (Qwen3-8B-b16 shapes on CUDA, eager and CUDA
graphs) or the dry plan (tiny shapes on CPU, eager only). Parts read only the plan, so the
dry run executes the same functions as the GPU run."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from vllm_dflash.gpu_check.shapes import QWEN3_8B_B16, TINY, ShapeSet

NO_GRAPHS = "dry run: no CUDA"


@dataclass(frozen=True)
class Plan:
    dry_run: bool
    device: torch.device
    shapes: ShapeSet
    graphs: bool  # also capture and replay CUDA graphs
    op_dtypes: tuple[torch.dtype, ...]  # part (a)
    drafter_dtype: torch.dtype  # part (b)
    op_warmup: int
    op_reps: int
    step_warmup: int
    step_reps: int
    vllm_sources: Path | None = None
    # Part (c): seconds per import probe, and for the whole engine comparison.
    probe_timeout_s: float = 60.0
    engine_timeout_s: float = 300.0

    @property
    def mode(self) -> str:
        return "dry-run" if self.dry_run else "gpu"


def make_plan(dry_run: bool, vllm_sources: Path | None = None) -> Plan:
    if dry_run:
        return Plan(
            dry_run=True,
            device=torch.device("cpu"),
            shapes=TINY,
            graphs=False,
            op_dtypes=(torch.bfloat16, torch.float16),
            drafter_dtype=torch.bfloat16,
            op_warmup=2,
            op_reps=5,
            step_warmup=1,
            step_reps=3,
            vllm_sources=vllm_sources,
        )
    return Plan(
        dry_run=False,
        device=torch.device("cuda", 0),
        shapes=QWEN3_8B_B16,
        graphs=True,
        op_dtypes=(torch.bfloat16, torch.float16),
        drafter_dtype=torch.bfloat16,
        op_warmup=10,
        op_reps=50,
        step_warmup=3,
        step_reps=20,
        vllm_sources=vllm_sources,
    )
