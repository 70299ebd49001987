"""The gpu-check command's arguments, without importing torch (``vllm-dflash --help`` stays
fast)."""

from __future__ import annotations

import argparse
from pathlib import Path

DEFAULT_BUDGET_S = 360.0
WATCHDOG_GRACE_S = 60.0  # past the budget: a check is hung (checks past it are skipped)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--out", type=Path, default=Path("gpu-check-out"), help="report directory (created)"
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="tiny shapes on CPU: CPU kernels, eager only, no engine (for CI)",
    )
    p.add_argument(
        "--vllm-sources",
        type=Path,
        help="a vLLM checkout (the directory holding the vllm package), put first on "
        "PYTHONPATH for part (c)'s import probes",
    )
    p.add_argument(
        "--budget-s",
        type=float,
        default=DEFAULT_BUDGET_S,
        help="checks starting after this many seconds are skipped; the run is stopped "
        f"{WATCHDOG_GRACE_S:.0f} s later whatever it is doing (default: {DEFAULT_BUDGET_S:.0f})",
    )
