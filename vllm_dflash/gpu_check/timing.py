"""Timing and CUDA-graph helpers shared by parts (a) and (b), parametrised by device."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn: Callable[[], Any], device: torch.device, warmup: int, reps: int) -> float:
    """Median milliseconds of one call of ``fn`` over ``reps`` calls after ``warmup``.

    CUDA: a pair of events around each call, so launch gaps between kernels count (that is
    what eager execution costs and a graph replay saves); CPU: wall clock per call."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    if device.type == "cuda":
        pairs = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            pairs.append((start, end))
        torch.cuda.synchronize(device)
        times = [s.elapsed_time(e) for s, e in pairs]
    else:
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def capture_graph(fn: Callable[[], Any], warmup: int = 3) -> tuple[torch.cuda.CUDAGraph, Any]:
    """Capture ``fn`` (which must read and write only static tensors) in a CUDA graph.

    As PyTorch's CUDA-graph docs ask, ``fn`` first runs a few times on a side stream, so lazy
    initialisation (cuBLAS handles, workspace, autotuning) happens outside the capture.
    Returns the graph and what ``fn`` returned during capture (its static outputs)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    torch.cuda.synchronize()
    return graph, out
