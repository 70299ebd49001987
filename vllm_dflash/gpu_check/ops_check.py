"""Part (a): the compiled ops against their PyTorch definitions (vllm_dflash/ops/reference.py),
eager and replayed from a captured CUDA graph, and their cost next to the reference.

The comparison rule is tests/test_custom_ops.py's: values are copied, so they must be exact;
keys and queries must satisfy ``|got - want| <= tol + tol * |want|`` (torch.testing's
assert_close with atol = rtol = tol), tol = 4 units in the last place of the stored type (an
intermediate rounding can go the other way and moves both elements of a RoPE pair). Rows the
op must not write (padding slots -1, every slot not in the batch) must not change, nor the
guard memory around each layer's cache.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from vllm_dflash.gpu_check import project
from vllm_dflash.gpu_check.plan import NO_GRAPHS, Plan
from vllm_dflash.gpu_check.results import CheckFailed, Outcome, PartResult, Table
from vllm_dflash.gpu_check.runner import Runner
from vllm_dflash.gpu_check.shapes import ShapeSet
from vllm_dflash.gpu_check.timing import capture_graph, synchronize, time_ms
from vllm_dflash.ops import reference as ops_reference

TOL = {torch.float32: 1e-5, torch.bfloat16: 4 * 2**-8, torch.float16: 4 * 2**-11}
EPS_NOTE = "tol = 4 ulp of the stored type (bf16 4*2^-8, fp16 4*2^-11), atol = rtol = tol"
SPARE_BLOCKS = 8  # cache blocks no request owns: they must stay untouched

Kernel = Callable[..., None]


def cos_sin_cache(shapes: ShapeSet, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[max_position, head_dim]: cos | sin of every position (vLLM's layout, full rotary)."""
    d = shapes.head_dim
    inv = 1.0 / (shapes.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    freqs = torch.outer(torch.arange(shapes.max_position, dtype=torch.float64), inv)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(dtype).to(device)


@dataclass
class Comparison:
    """One op call against the reference: ok, or each way it differs, named."""

    mismatches: list[str] = field(default_factory=list)
    max_abs_err: float = 0.0  # keys (inject) or queries and keys (qk_norm_rope)
    worst_tolerance_fraction: float = 0.0  # max of |err| / (tol + tol * |want|)
    rows_written: int = 0
    padding_rows: int = 0

    @property
    def ok(self) -> bool:
        return not self.mismatches

    def outcome(self) -> Outcome:
        metrics = asdict(self)
        if not self.ok:
            raise CheckFailed("; ".join(self.mismatches), metrics)
        return Outcome(
            f"max |err| {self.max_abs_err:.3g} ({100 * self.worst_tolerance_fraction:.0f}% of "
            f"tolerance), {self.rows_written} rows, {self.padding_rows} padding",
            metrics,
        )


def _close(comp: Comparison, name: str, got: torch.Tensor, want: torch.Tensor, tol: float):
    """Record in ``comp`` how far ``got`` is from ``want`` under the assert_close rule."""
    got, want = got.float(), want.float()
    err = (got - want).abs()
    allowed = tol + tol * want.abs()
    bad = int((~(err <= allowed)).sum())  # NaN counts as bad
    if err.numel():
        comp.max_abs_err = max(comp.max_abs_err, float(err.max()))
        comp.worst_tolerance_fraction = max(
            comp.worst_tolerance_fraction, float((err / allowed).max())
        )
    if bad:
        comp.mismatches.append(
            f"{name}: {bad} element(s) beyond tolerance (max |err| {float(err.max()):.3g}, "
            f"tol {tol:.3g})"
        )


def _exact(comp: Comparison, name: str, got: torch.Tensor, want: torch.Tensor, why: str):
    diff = int((got != want).sum())
    if diff:
        comp.mismatches.append(f"{name}: {diff} element(s) differ ({why})")


# ---- inject_context_kv ------------------------------------------------------------------


@dataclass
class InjectCase:
    """Static buffers of one inject_context_kv call; a CUDA graph replays on exactly these.

    The caches use vLLM's FlashAttention layout: per layer [blocks, kv_heads, block_size,
    2 * head_dim], written through the key and value views [blocks, block_size, kv_heads,
    head_dim] its do_kv_cache_update makes (transpose(1, 2), then split the last dim). All
    layers are views of one allocation, with a guard block before and after each layer."""

    kv: torch.Tensor  # [tokens, layers, 2, kv_heads, head_dim]
    k_norm_weight: torch.Tensor  # [layers, head_dim]
    eps: float
    positions: torch.Tensor  # [tokens] int64
    cos_sin: torch.Tensor  # [max_position, head_dim]
    is_neox: bool
    slots: torch.Tensor  # [tokens] int64; -1 = padding
    store: torch.Tensor  # [layers, blocks + 2, kv_heads, block_size, 2 * head_dim]
    key_caches: list[torch.Tensor]  # per layer [blocks, block_size, kv_heads, head_dim]
    value_caches: list[torch.Tensor]

    def args(self) -> tuple:
        return (
            self.kv,
            self.k_norm_weight,
            self.eps,
            self.positions,
            self.cos_sin,
            self.is_neox,
            self.slots,
            self.key_caches,
            self.value_caches,
        )

    @property
    def blocks(self) -> int:
        return self.store.shape[1] - 2


def context_slots(shapes: ShapeSet, blocks: int, gen: torch.Generator):
    """Positions and cache slots [requests * block_size] of one context-commit batch.

    Every request commits block_size consecutive positions from a random start, so its rows
    usually span two KV blocks (request 0's always do); each request owns two random physical
    blocks. A padded tail (the last request's last 3 rows) and one row in the middle are -1.
    """
    bs, r = shapes.block_size, shapes.requests
    phys = torch.randperm(blocks, generator=gen)[: 2 * r].view(r, 2)
    start = torch.randint(0, shapes.max_position - 2 * bs, (r,), generator=gen)
    start[0] += bs - 2 - start[0] % bs  # offset bs - 2: crosses into the next block
    pos = start[:, None] + torch.arange(bs)  # [requests, block_size]
    logical = pos // bs - (start // bs)[:, None]  # 0 or 1: which of the request's blocks
    slots = phys.gather(1, logical) * bs + pos % bs
    slots[r - 1, bs - 3 :] = -1
    slots[r // 2, bs // 2] = -1
    return pos.flatten(), slots.flatten()


def make_inject_case(
    shapes: ShapeSet, dtype: torch.dtype, device: torch.device, gen: torch.Generator
) -> InjectCase:
    n, layers = shapes.context_rows, shapes.num_drafter_layers
    heads, d, bs = shapes.num_key_value_heads, shapes.head_dim, shapes.block_size
    blocks = 2 * shapes.requests + SPARE_BLOCKS
    store = torch.empty(layers, blocks + 2, heads, bs, 2 * d, dtype=dtype, device=device)
    keys, values = [], []
    for layer in range(layers):
        k, v = store[layer, 1:-1].transpose(1, 2).split(d, dim=-1)
        keys.append(k)
        values.append(v)
    case = InjectCase(
        kv=torch.empty(n, layers, 2, heads, d, dtype=dtype, device=device),
        k_norm_weight=torch.empty(layers, d, dtype=dtype, device=device),
        eps=shapes.rms_norm_eps,
        positions=torch.empty(n, dtype=torch.long, device=device),
        cos_sin=cos_sin_cache(shapes, dtype, device),
        is_neox=True,  # Qwen3
        slots=torch.empty(n, dtype=torch.long, device=device),
        store=store,
        key_caches=keys,
        value_caches=values,
    )
    fill_inject_case(case, shapes, gen)
    return case


def fill_inject_case(case: InjectCase, shapes: ShapeSet, gen: torch.Generator) -> None:
    """New random inputs and cache contents, copied into the case's buffers in place."""
    dtype = case.kv.dtype
    case.kv.copy_(torch.randn(case.kv.shape, generator=gen).to(dtype))
    case.k_norm_weight.copy_((torch.rand(case.k_norm_weight.shape, generator=gen) + 0.5).to(dtype))
    pos, slots = context_slots(shapes, case.blocks, gen)
    case.positions.copy_(pos)
    case.slots.copy_(slots)
    case.store.copy_(torch.randn(case.store.shape, generator=gen).to(dtype))


def compare_inject(kernel: Kernel, case: InjectCase, reference: Kernel) -> Comparison:
    """Run ``kernel`` on the case's buffers and ``reference`` on copies; name differences."""
    tol = TOL[case.kv.dtype]
    store_before = case.store.clone()
    want_k = [c.clone() for c in case.key_caches]
    want_v = [c.clone() for c in case.value_caches]
    kernel(*case.args())
    synchronize(case.kv.device)
    reference(*case.args()[:7], want_k, want_v)
    written = torch.zeros(case.blocks * case.key_caches[0].shape[1], dtype=torch.bool)
    slots = case.slots.cpu()
    written[slots[slots >= 0]] = True
    written = written.to(case.kv.device)
    comp = Comparison(rows_written=int(written.sum()), padding_rows=int((slots < 0).sum()))
    before = store_before[:, 1:-1].transpose(2, 3)  # [layers, blocks, block_size, heads, 2d]
    d = case.kv.shape[-1]
    for layer, (got_k, got_v) in enumerate(zip(case.key_caches, case.value_caches, strict=True)):
        _exact(comp, f"layer {layer} value cache", got_v, want_v[layer], "values must be exact")
        _close(comp, f"layer {layer} key cache", got_k, want_k[layer], tol)
        for name, got, old in (
            ("key", got_k, before[layer, ..., :d]),
            ("value", got_v, before[layer, ..., d:]),
        ):
            rows_got = got.reshape(written.numel(), -1)[~written]
            rows_old = old.reshape(written.numel(), -1)[~written]
            changed = int((rows_got != rows_old).any(dim=-1).sum())
            if changed:
                comp.mismatches.append(
                    f"layer {layer} {name} cache: {changed} row(s) outside the batch's slots "
                    "changed (padding slots -1 and unused slots must stay untouched)"
                )
    for edge, idx in (("before", 0), ("after", -1)):
        if not torch.equal(case.store[:, idx], store_before[:, idx]):
            comp.mismatches.append(
                f"guard block {edge} the caches changed: a write outside the cache views"
            )
    return comp


# ---- qk_norm_rope -----------------------------------------------------------------------


@dataclass
class QkCase:
    qkv: torch.Tensor  # [tokens, (heads + 2 * kv_heads) * head_dim], in place
    q_weight: torch.Tensor  # [head_dim]
    k_weight: torch.Tensor  # [head_dim]
    eps: float
    positions: torch.Tensor  # [tokens] int64
    cos_sin: torch.Tensor  # [max_position, head_dim]
    is_neox: bool
    num_heads: int
    num_kv_heads: int

    def args(self) -> tuple:
        return (
            self.qkv,
            self.q_weight,
            self.k_weight,
            self.eps,
            self.positions,
            self.cos_sin,
            self.is_neox,
            self.num_heads,
            self.num_kv_heads,
        )


def make_qk_case(
    shapes: ShapeSet, dtype: torch.dtype, device: torch.device, gen: torch.Generator
) -> QkCase:
    d, n = shapes.head_dim, shapes.context_rows
    case = QkCase(
        qkv=torch.empty(n, shapes.qkv_width, dtype=dtype, device=device),
        q_weight=torch.empty(d, dtype=dtype, device=device),
        k_weight=torch.empty(d, dtype=dtype, device=device),
        eps=shapes.rms_norm_eps,
        positions=torch.empty(n, dtype=torch.long, device=device),
        cos_sin=cos_sin_cache(shapes, dtype, device),
        is_neox=True,
        num_heads=shapes.num_attention_heads,
        num_kv_heads=shapes.num_key_value_heads,
    )
    fill_qk_case(case, shapes, gen)
    return case


def fill_qk_case(case: QkCase, shapes: ShapeSet, gen: torch.Generator) -> None:
    dtype = case.qkv.dtype
    case.qkv.copy_(torch.randn(case.qkv.shape, generator=gen).to(dtype))
    for w in (case.q_weight, case.k_weight):
        w.copy_((torch.rand(w.shape, generator=gen) + 0.5).to(dtype))
    n = case.positions.shape[0]
    case.positions.copy_(torch.randint(0, shapes.max_position, (n,), generator=gen))


def compare_qk(kernel: Kernel, case: QkCase, reference: Kernel) -> Comparison:
    tol = TOL[case.qkv.dtype]
    before = case.qkv.clone()
    want = case.qkv.clone()
    kernel(*case.args())
    synchronize(case.qkv.device)
    reference(want, *case.args()[1:])
    n, h, k = case.qkv.shape[0], case.num_heads, case.num_kv_heads
    got_h, want_h, before_h = (t.view(n, h + 2 * k, -1) for t in (case.qkv, want, before))
    comp = Comparison(rows_written=n)
    _close(comp, "query heads", got_h[:, :h], want_h[:, :h], tol)
    _close(comp, "key heads", got_h[:, h : h + k], want_h[:, h : h + k], tol)
    _exact(comp, "value heads", got_h[:, h + k :], before_h[:, h + k :], "must stay untouched")
    return comp


# ---- the part ---------------------------------------------------------------------------


@dataclass(frozen=True)
class OpSpec:
    name: str
    make: Callable[[ShapeSet, torch.dtype, torch.device, torch.Generator], Any]
    fill: Callable[[Any, ShapeSet, torch.Generator], None]
    compare: Callable[[Kernel, Any, Kernel], Comparison]
    rows: Callable[[ShapeSet], str]


OP_SPECS = (
    OpSpec(
        "inject_context_kv",
        make_inject_case,
        fill_inject_case,
        compare_inject,
        lambda s: (
            f"{s.context_rows} rows x {s.num_drafter_layers} layers x "
            f"{s.num_key_value_heads} kv heads"
        ),
    ),
    OpSpec(
        "qk_norm_rope",
        make_qk_case,
        fill_qk_case,
        compare_qk,
        lambda s: (
            f"{s.context_rows} rows x ({s.num_attention_heads} q + {s.num_key_value_heads} k) heads"
        ),
    ),
)


def _short(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def run(part: PartResult, runner: Runner, plan: Plan, ext: project.Extension) -> None:
    shapes, device = plan.shapes, plan.device
    part.info.update(
        shapes=shapes.name,
        device=str(device),
        reference="vllm_dflash/ops/reference.py",
        rows=shapes.context_rows,
        cache_layout="vLLM FlashAttention: per layer [blocks, kv_heads, block_size, "
        f"2 * head_dim], block_size {shapes.block_size}, key/value views",
        tolerance=EPS_NOTE,
    )
    missing = None if ext.has_kernels(device) else ext.missing_reason(device)
    timing_rows = []
    for spec in OP_SPECS:
        for dtype in plan.op_dtypes:
            label = f"{spec.name} {_short(dtype)}"
            seed = zlib.crc32(label.encode())
            gen = torch.Generator().manual_seed(seed)
            op = getattr(torch.ops.vllm_dflash, spec.name) if missing is None else None
            reference = getattr(ops_reference, spec.name)
            state: dict[str, Any] = {}

            def eager(spec=spec, dtype=dtype, gen=gen, op=op, reference=reference, state=state):
                if missing is not None:
                    raise CheckFailed(missing)
                state["case"] = case = spec.make(shapes, dtype, device, gen)
                return spec.compare(op, case, reference).outcome()

            def graph(spec=spec, gen=gen, op=op, reference=reference, state=state, dtype=dtype):
                if missing is not None:
                    raise CheckFailed(missing)
                case = state.get("case") or spec.make(shapes, dtype, device, gen)
                g, _ = capture_graph(lambda: op(*case.args()))
                state["graph"] = g
                # New inputs in the captured buffers: the replay must read them (not what
                # was there at capture) for its result to match the reference on them.
                spec.fill(case, shapes, gen)
                return spec.compare(lambda *_: g.replay(), case, reference).outcome()

            def timing(spec=spec, dtype=dtype, gen=gen, op=op, reference=reference, state=state):
                case = state.get("case") or spec.make(shapes, dtype, device, gen)
                w, r = plan.op_warmup, plan.op_reps
                us: dict[str, float | None] = {
                    "kernel_eager_us": None,
                    "graph_replay_us": None,
                    "reference_us": 1e3 * time_ms(lambda: reference(*case.args()), device, w, r),
                }
                if op is not None:
                    us["kernel_eager_us"] = 1e3 * time_ms(lambda: op(*case.args()), device, w, r)
                if "graph" in state:
                    us["graph_replay_us"] = 1e3 * time_ms(state["graph"].replay, device, w, r)
                no_graph = None if plan.graphs else NO_GRAPHS
                row = [spec.name, _short(dtype), spec.rows(shapes), *_cells(us, no_graph)]
                timing_rows.append(row)
                return Outcome(", ".join(f"{k} {_fmt(v)}" for k, v in us.items()), us)

            runner.check(part, f"{label} eager vs reference", eager)
            runner.check(
                part,
                f"{label} CUDA graph replay vs reference",
                graph,
                skip=None if plan.graphs else NO_GRAPHS,
            )
            runner.check(part, f"{label} timing", timing)
            state.clear()  # drop the buffers and the graph before the next case
    part.tables.append(
        Table(
            f"Op cost on {device.type.upper()} (µs per call, median of {plan.op_reps})",
            [
                "op",
                "dtype",
                "work",
                "kernel eager",
                "kernel CUDA graph replay",
                "unfused PyTorch (reference.py)",
                "PyTorch / kernel eager",
                "kernel eager / graph replay",
            ],
            timing_rows,
            note=_timing_note(device) + " The unfused column runs "
            "vllm_dflash/ops/reference.py (several ATen ops and a boolean-mask index that syncs "
            "for inject_context_kv); the served PyTorch path uses vLLM's own ops instead.",
        )
    )
    if missing is not None:
        part.status, part.reason = "failed", missing


def _timing_note(device: torch.device) -> str:
    if device.type == "cuda":
        return "CUDA events around each call, so launch gaps count."
    return "Wall clock per call."


def _cells(us: dict[str, float | None], no_graph: str | None) -> list[str]:
    eager, graph, ref = us["kernel_eager_us"], us["graph_replay_us"], us["reference_us"]
    if no_graph:
        skipped = f"skipped ({no_graph})"
        return [_fmt(eager), skipped, _fmt(ref), _ratio(ref, eager), skipped]
    return [_fmt(eager), _fmt(graph), _fmt(ref), _ratio(ref, eager), _ratio(eager, graph)]


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.1f}x" if a and b and math.isfinite(a / b) else "n/a"


def _fmt(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.1f}"
