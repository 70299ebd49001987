"""Part (b): one drafting step of the reference drafter (vllm_dflash.reference.model) with
random weights, eager and as a CUDA-graph replay, per batch size and draft length.

A step: the block (anchor + draft_len mask positions) through every drafter layer against a
dense context, the final norm, the LM head at the draft_len mask positions, argmax. This is the
reference PyTorch drafter, not the module vLLM serves: same math and shapes, but SDPA over a
dense per-request context instead of vLLM's paged attention, and no vLLM scheduling around it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from vllm_dflash.gpu_check import project
from vllm_dflash.gpu_check.plan import NO_GRAPHS, Plan
from vllm_dflash.gpu_check.results import CheckFailed, CheckSkipped, Outcome, PartResult, Table
from vllm_dflash.gpu_check.runner import Runner, free_memory
from vllm_dflash.gpu_check.timing import capture_graph, synchronize, time_ms
from vllm_dflash.reference.model import DFlashDrafter

NOTE = (
    "Reference PyTorch drafter (vllm_dflash/reference/model.py, DFlashDrafter) with random "
    "weights: the same math and shapes as the served drafter, but SDPA attention over a dense "
    "context (K/V repeated per query head) instead of vLLM's paged attention, and no vLLM "
    "around it. It is not the vLLM-served module; read the numbers as the drafter's GPU work "
    "per step and what CUDA graphs save on it."
)
MIN_GRAPH_AGREEMENT = 0.9  # below this the replay computes something else, not a rounding tie


@dataclass
class Drafter:
    """Everything a step reads that does not depend on (B, draft_len); built once."""

    model: torch.nn.Module
    lm_head: torch.Tensor  # [vocab, hidden]
    context: list[tuple[torch.Tensor, torch.Tensor]]  # per layer [B_max, kv_heads, T, d] each


def build_drafter(plan: Plan) -> tuple[Drafter, dict[str, Any]]:
    shapes, device, dtype = plan.shapes, plan.device, plan.drafter_dtype
    torch.manual_seed(0)
    with torch.device(device):
        model = DFlashDrafter(project.drafter_config(shapes))  # random init, on the device
    model = model.to(dtype).eval().requires_grad_(False)
    h, b_max = shapes.hidden_size, max(shapes.batch_sizes)
    lm_head = torch.randn(shapes.vocab_size, h, dtype=dtype, device=device).mul_(h**-0.5)
    kv_shape = (b_max, shapes.num_key_value_heads, shapes.context_len, shapes.head_dim)
    # Post-norm, post-RoPE context K and V: unit-scale random values stand in for them.
    context = [
        (
            torch.randn(kv_shape, dtype=dtype, device=device),
            torch.randn(kv_shape, dtype=dtype, device=device),
        )
        for _ in range(shapes.num_drafter_layers)
    ]
    params = sum(p.numel() for p in model.parameters())
    info = {
        "model": "vllm_dflash/reference/model.py (DFlashDrafter)",
        "drafter_params": params,
        "lm_head_params": lm_head.numel(),
        "dtype": str(dtype).removeprefix("torch."),
    }
    return Drafter(model, lm_head, context), info


def step_fn(d: Drafter, plan: Plan, batch: int, draft_len: int):
    """A drafting step on static inputs for (batch, draft_len), and those inputs."""
    shapes, device, dtype = plan.shapes, plan.device, plan.drafter_dtype
    s = draft_len + 1  # anchor + draft_len masks
    embeds = torch.randn(batch, s, shapes.hidden_size, dtype=dtype, device=device)  # [B, s, h]
    positions = (shapes.context_len + torch.arange(s, device=device)).expand(batch, s)  # [B, s]
    positions = positions.contiguous()
    ctx = [(k[:batch], v[:batch]) for k, v in d.context]  # views: addresses stay fixed

    def step() -> torch.Tensor:
        hidden = d.model.forward_block(embeds, positions, ctx)  # [B, s, h], final norm applied
        logits = hidden[:, 1:] @ d.lm_head.T  # [B, draft_len, vocab]: the anchor predicts nothing
        return logits.argmax(dim=-1)  # [B, draft_len]

    return step


def run(part: PartResult, runner: Runner, plan: Plan) -> None:
    shapes, device = plan.shapes, plan.device
    part.notes.append(NOTE)
    part.info.update(
        shapes=shapes.name,
        device=str(device),
        context_len=shapes.context_len,
        batch_sizes=list(shapes.batch_sizes),
        draft_lens=list(shapes.draft_lens),
        reps=f"median of {plan.step_reps} after {plan.step_warmup} warm-up",
    )
    state: dict[str, Any] = {}

    def build() -> Outcome:
        state["drafter"], info = build_drafter(plan)
        part.info.update(info)
        return Outcome(
            f"{info['drafter_params'] / 1e6:.4g}M drafter + {info['lm_head_params'] / 1e6:.4g}M "
            f"LM head parameters, {info['dtype']}",
            info,
        )

    built = runner.check(part, "build drafter", build).status == "ok"
    rows = []
    for batch in shapes.batch_sizes:
        for draft_len in shapes.draft_lens:
            res: dict[str, Any] = {}

            def eager(batch=batch, draft_len=draft_len, res=res) -> Outcome:
                step = step_fn(state["drafter"], plan, batch, draft_len)
                with torch.no_grad():
                    res["eager_ms"] = time_ms(step, device, plan.step_warmup, plan.step_reps)
                    res["tokens"] = step()
                res["step"] = step
                return Outcome(f"{res['eager_ms']:.3f} ms", {"eager_ms": res["eager_ms"]})

            def graph(res=res) -> Outcome:
                if "step" not in res:
                    raise CheckSkipped("eager step did not run")
                with torch.no_grad():
                    g, out = capture_graph(res["step"])
                    g.replay()
                    synchronize(device)
                    agree = float((out == res["tokens"]).float().mean())
                    res["graph_ms"] = time_ms(g.replay, device, plan.step_warmup, plan.step_reps)
                del g, out
                res["agree"] = agree
                metrics = {"graph_ms": res["graph_ms"], "graph_tokens_match_eager": agree}
                if agree < MIN_GRAPH_AGREEMENT:
                    raise CheckFailed(
                        f"graph replay's draft tokens match eager's on only {100 * agree:.0f}%",
                        metrics,
                    )
                speedup = res["eager_ms"] / res["graph_ms"]
                return Outcome(f"{res['graph_ms']:.3f} ms ({speedup:.2f}x eager)", metrics)

            not_built = None if built else "drafter not built"
            runner.check(part, f"B={batch} draft_len={draft_len} eager", eager, skip=not_built)
            runner.check(
                part,
                f"B={batch} draft_len={draft_len} CUDA graph",
                graph,
                skip=not_built or (None if plan.graphs else NO_GRAPHS),
            )
            rows.append(_row(batch, draft_len, res, plan))
            res.clear()
            free_memory()  # each graph holds its own memory pool
    state.clear()
    part.tables.append(
        Table(
            f"Drafting step, ms (B = batch, draft_len = draft tokens; block = draft_len + 1 "
            f"positions; context {shapes.context_len} per request)",
            [
                "B",
                "draft_len",
                "eager ms",
                "CUDA graph ms",
                "graph speedup",
                "graph tokens = eager",
            ],
            rows,
        )
    )


def _row(batch: int, draft_len: int, res: dict[str, Any], plan: Plan) -> list[Any]:
    eager, graph = res.get("eager_ms"), res.get("graph_ms")
    if not plan.graphs:
        skipped = f"skipped ({NO_GRAPHS})"
        return [batch, draft_len, _ms(eager), skipped, skipped, skipped]
    speedup = f"{eager / graph:.2f}x" if eager and graph else "n/a"
    agree = f"{100 * res['agree']:.0f}%" if "agree" in res else "n/a"
    return [batch, draft_len, _ms(eager), _ms(graph), speedup, agree]


def _ms(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.3f}"
