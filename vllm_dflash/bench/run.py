"""``vllm-dflash bench``: every backend on the same prompts, in one run, on real vLLM engines.

    vllm-dflash bench [--target T --draft D] [--backends dflash,builtin,none]
        [--concurrency 1,4,16,32] [--prompts P.jsonl --num-prompts N --max-tokens M]
        [--k K --repeats R] [--tensor-parallel-size N] [--drafts always|never]
        [--json out.json] [--plot out.png] [--workdir DIR]
        [--sweep-draft-cost [--sweep-draft-lens 1,2,3,4,6,8,12,15]]

Backends: ``dflash`` (ours, with its draft policy, ``docs/draft-policy.md``),
``dflash-fixed`` (ours, K drafts every step), ``builtin`` (vLLM's), ``adaptive`` (ours, draft
length chosen per step, ``docs/adaptive-draft-length.md``), ``none``; ``:K`` sets one
backend's draft tokens per step (``dflash:7``), ``--k`` everyone else's (default: block
size - 1).

``--drafts always`` / ``never``: adversarial drafters built from any target. The drafter
still runs, but its tokens are replaced by the target's own greedy continuation (every
draft accepted) or by tokens that differ from it (none accepted), for every speculating
backend alike (``serving/bench_drafts.py``); the continuation comes from one extra
no-speculation pass before the engines start.

Defaults: the embedded default (target, drafter, held-out prompts). Prints a markdown
table (output tok/s, acceptance length, speedup vs ``none``, ratio vs ``builtin``, TTFT
and TPOT percentiles, whether greedy outputs equal ``none``'s); ``--json`` writes the rows
and ``--plot`` a figure of tok/s and acceptance length against concurrency. Exits 1 when
any backend's greedy output differs from ``none``'s, 2 on bad input (nothing started).
``--sweep-draft-cost`` measures step costs against draft length instead (``bench/sweep.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from dataclasses import asdict
from pathlib import Path

from vllm_dflash import assets
from vllm_dflash.errors import DFlashConfigError, DFlashDataError


def _ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give integers like 1,4,16") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: every value must be >= 1")
    return values


def _backends(text: str) -> list[str]:
    from vllm_dflash.bench.compare_backends import parse_backend

    names = [x.strip() for x in text.split(",") if x.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"{text!r}: name at least one backend")
    for name in names:
        try:
            parse_backend(name)
        except DFlashConfigError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return names


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench",
        help="ours vs vLLM's built-in dflash vs no speculation, one run, real engines",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--target", type=Path, default=assets.TARGET)
    p.add_argument("--draft", type=Path, default=assets.DRAFTER)
    p.add_argument(
        "--backends",
        type=_backends,
        default=["dflash", "builtin", "none"],
        help="dflash, dflash-pytorch (ours without the csrc/ ops), builtin, adaptive, none; "
        "':K' sets a backend's draft tokens (dflash:7)",
    )
    p.add_argument("--concurrency", type=_ints, default=[1, 4, 16, 32])
    p.add_argument("--prompts", type=Path, default=assets.HELDOUT_PROMPTS)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--k", type=int, help="draft tokens per step (default: block size - 1)")
    p.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="ranks per engine (target and drafter sharded alike); on a CPU build each rank "
        "gets an equal share of the cores unless VLLM_CPU_OMP_THREADS_BIND is set",
    )
    p.add_argument("--repeats", type=int, default=3, help="timed passes per backend and load")
    p.add_argument(
        "--drafts",
        choices=("drafter", "always", "never"),
        default="drafter",
        help="the drafter's own drafts, or adversarial ones: always or never accepted",
    )
    p.add_argument("--json", type=Path, help="write the rows as JSON here")
    p.add_argument("--plot", type=Path, help="write tok/s and acceptance plots here (.png)")
    p.add_argument("--workdir", type=Path, help="engine logs and raw passes (default: temp)")
    p.add_argument(
        "--sweep-draft-cost",
        action="store_true",
        help="instead: drafter and verify time against draft length per concurrency, the "
        "analytic model fitted to them, and its predicted speedup against the measured one",
    )
    p.add_argument(
        "--sweep-draft-lens", type=_ints, help="draft lengths to sweep (default: 1,2,3,4,6,8,12,K)"
    )
    p.set_defaults(func=run)


def load_prompts(path: Path, target: Path, n: int) -> list[list[int]]:
    """Token ids of the first ``n`` prompts of a prompt JSONL file (see data/records.py)."""
    from transformers import AutoTokenizer

    from vllm_dflash.data.records import encode_prompt, read_prompts

    if n < 1:
        raise DFlashDataError(f"--num-prompts {n}: need at least 1 prompt")
    records = read_prompts(path)[:n]
    if not records:
        raise DFlashDataError(f"{path}: no usable prompt. Fix: give a JSONL file of prompts")
    tok = AutoTokenizer.from_pretrained(target)
    return [encode_prompt(tok, r.data) for r in records]


def _check_models(args: argparse.Namespace) -> None:
    from vllm_dflash.config import DrafterConfig

    for name in ("target", "draft"):
        if not (getattr(args, name) / "config.json").is_file():
            raise DFlashConfigError(
                f"--{name} {getattr(args, name)}: no config.json there. Fix: give a model directory"
            )
    from vllm_dflash.bench.compare_backends import parse_backend

    if args.tensor_parallel_size < 1:
        raise DFlashConfigError(f"--tensor-parallel-size {args.tensor_parallel_size}: need >= 1")
    if args.tensor_parallel_size > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        from vllm_dflash.bench.compare_backends import cpu_binding

        cpu_binding(args.tensor_parallel_size)  # enough cores for one rank each
    block = DrafterConfig.from_file(args.draft / "config.json").block_size
    args.k = args.k or block - 1
    if not 1 <= args.k < block:
        raise DFlashConfigError(f"--k {args.k}: the drafter drafts 1..{block - 1} tokens")
    for name in args.backends:
        k = parse_backend(name)[1]
        if k is not None and k >= block:
            raise DFlashConfigError(f"backend {name}: the drafter drafts 1..{block - 1} tokens")
    for g in args.sweep_draft_lens or ():
        if g > args.k:
            raise DFlashConfigError(f"--sweep-draft-lens {g}: at most --k = {args.k} draft tokens")


def plot(rows: list, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_tps, ax_tau) = plt.subplots(1, 2, figsize=(10, 4))
    for backend in dict.fromkeys(r.backend for r in rows):
        mine = [r for r in rows if r.backend == backend]
        cs = [r.concurrency for r in mine]
        ax_tps.plot(cs, [r.tokens_per_s for r in mine], marker="o", label=backend)
        if mine[0].acceptance_length is not None:
            ax_tau.plot(cs, [r.acceptance_length for r in mine], marker="o", label=backend)
    for ax, title in ((ax_tps, "output tokens/s"), (ax_tau, "acceptance length")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    from vllm_dflash.bench.compare_backends import compare, markdown, measure

    _check_models(args)
    prompts = load_prompts(args.prompts, args.target, args.num_prompts)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="vllm-dflash-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    if args.sweep_draft_cost:
        from vllm_dflash.bench import sweep

        return _report(args, *sweep.sweep(args, prompts, workdir), sweep.plot)
    backends = list(dict.fromkeys([*args.backends, "none"]))  # speedups need the baseline
    env = None if args.drafts == "drafter" else _adversarial(args, prompts, workdir)
    passes = measure(args, prompts, workdir, backends, env)  # an engine failure exits 2
    seconds = {f"{b}@{c}": [r.seconds for r in runs] for (b, c), runs in passes.items()}
    (workdir / "pass_seconds.json").write_text(json.dumps(seconds, indent=1))
    rows = compare(passes, args.concurrency, backends)
    return _report(args, rows, markdown(rows), plot)


def _adversarial(args: argparse.Namespace, prompts, workdir: Path) -> dict[str, str]:
    """One no-speculation pass for the target's greedy continuations (K + 1 tokens past
    ``--max-tokens``, so the last drafts have theirs too); the engines' environment that
    replaces every draft from them (``serving/bench_drafts.py``)."""
    from vllm_dflash.bench.compare_backends import Engine

    longer = argparse.Namespace(**vars(args) | {"max_tokens": args.max_tokens + args.k + 1})
    (workdir / "oracle").mkdir(exist_ok=True)
    engine = Engine("none", longer, prompts, workdir / "oracle")
    try:
        outputs = engine.run(len(prompts)).outputs
    finally:
        engine.close()
    path = workdir / "oracle.json"
    path.write_text(json.dumps([[p, o] for p, o in zip(prompts, outputs, strict=True)]))
    return {"VLLM_DFLASH_BENCH_DRAFTS": args.drafts, "VLLM_DFLASH_BENCH_ORACLE": str(path)}


def _report(args: argparse.Namespace, rows: list, text: str, plot_rows) -> int:
    """Print the tables, write ``--json`` and ``--plot``; exit 1 if any greedy output
    differed from no speculation's."""
    print(text)
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=2))
    if args.plot:
        plot_rows(rows, args.plot)
        print(f"plot: {args.plot}")
    return 0 if all(r.matches_none for r in rows) else 1
