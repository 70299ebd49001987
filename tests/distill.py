"""A few hundred steps of the real training pipeline, so tests get a drafter that is often right.

A random drafter is almost never accepted, and then an acceptance-length comparison proves
little: a drafter fed the wrong context would score the same ~1.0. This writes the
target's own greedy continuations of ``prompts`` as a samples file (the reference engine
stands in for ``gen-data`` here, which needs a vLLM engine) and runs
:class:`vllm_dflash.train.trainer.Trainer` on them, so every drafter the serving tests load
through vLLM (ours and the built-in) is an export of the training pipeline.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from vllm_dflash.reference.generate import target_generate
from vllm_dflash.reference.target import HFTarget
from vllm_dflash.train.config import TrainConfig
from vllm_dflash.train.trainer import Trainer


def write_samples(
    target: HFTarget, prompts: Sequence[Sequence[int]], path: Path, new_tokens: int
) -> Path:
    with path.open("w") as f:
        for i, p in enumerate(prompts):
            response = target_generate(target, p, new_tokens).tokens
            rec = {"id": i, "prompt_token_ids": list(p), "response_token_ids": response}
            f.write(json.dumps(rec) + "\n")
    return path


def distill(
    target: HFTarget,
    drafter_dir: str | Path,
    out: str | Path,
    prompts: Sequence[Sequence[int]],
    *,
    new_tokens: int = 64,
    steps: int = 300,
    lr: float = 3e-3,
    **overrides,
) -> Path:
    """Train ``drafter_dir`` (its config and weights as the start) on ``prompts``; the
    drafter is evaluated on the same prompts (these tests want a drafter that fits them)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    target_dir = Path(target.model.name_or_path)
    data = write_samples(target, prompts, out / "samples.jsonl", new_tokens)
    eval_prompts = out / "prompts.jsonl"
    eval_prompts.write_text(
        "".join(json.dumps({"prompt_token_ids": list(p)}) + "\n" for p in prompts)
    )
    cfg = TrainConfig.load(
        None,
        {
            "target": target_dir,
            "data": data,
            "out": out,
            "init_from": drafter_dir,
            "eval_prompts": eval_prompts,
            "eval_num_prompts": 4,
            "eval_max_tokens": 16,
            "eval_every": 0,
            "save_every": 0,
            "steps": steps,
            "lr": lr,
            "warmup_steps": 0,
            "min_lr_ratio": 1.0,
            "batch_size": 1,
            "blocks_per_seq": 8,
        }
        | overrides,
    )
    return Trainer(cfg).run()
