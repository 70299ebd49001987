"""`make demo`: the reference engine on tiny seeded models, with real measured numbers.

Until the trained embedded default ships (training issue), the drafter here has random
weights, so acceptance is low and DFlash is slower than plain decoding; the point is that
every number is measured and that output equality is checked, not assumed.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import AutoTokenizer

from vllm_dflash.bench.analytic import speedup
from vllm_dflash.reference.drafter import ReferenceDrafter
from vllm_dflash.reference.generate import spec_generate, target_generate
from vllm_dflash.reference.target import HFTarget
from vllm_dflash.testing.factory import tiny_models

DEMO_PROMPTS = [
    "def fibonacci(n):\n    ",
    "import os\nimport sys\n\n",
    "class Stack:\n    def __init__(self):\n        ",
    "for i in range(10):\n    print(",
    "# read a file and count the lines\nwith open(path) as f:\n    ",
    "def is_prime(n):\n    if n < 2:\n        return False\n    ",
    "x = [i * i for i in ",
    "try:\n    value = int(text)\nexcept ValueError:\n    ",
]


@dataclass
class DemoReport:
    num_prompts: int
    block_size: int
    tokens: int
    acceptance_length: float
    target_tokens_per_s: float
    dflash_tokens_per_s: float
    predicted_speedup: float
    lossless: bool

    @property
    def speedup(self) -> float:
        return self.dflash_tokens_per_s / self.target_tokens_per_s

    def table(self) -> str:
        rows = [
            ("prompts x max tokens", f"{self.num_prompts} x {self.tokens // self.num_prompts}"),
            ("block size (draft tokens)", f"{self.block_size} ({self.block_size - 1})"),
            ("acceptance length tau", f"{self.acceptance_length:.3f}"),
            ("target-only decode tok/s", f"{self.target_tokens_per_s:.1f}"),
            ("DFlash decode tok/s", f"{self.dflash_tokens_per_s:.1f}"),
            ("speedup (measured)", f"{self.speedup:.2f}x"),
            ("speedup (analytic model, measured costs)", f"{self.predicted_speedup:.2f}x"),
            ("lossless (greedy, token for token)", "yes" if self.lossless else "NO"),
        ]
        w = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{w}}  {v}" for k, v in rows)


def run_demo(
    workdir: str | Path, num_prompts: int = 8, max_new_tokens: int = 64, block_size: int = 8
) -> DemoReport:
    torch.manual_seed(0)
    models = tiny_models(workdir, block_size=block_size)
    tok = AutoTokenizer.from_pretrained(models.target_dir)
    target = HFTarget.from_pretrained(models.target_dir)
    drafter = ReferenceDrafter.load(models.drafter_dir, target)
    prompts = [DEMO_PROMPTS[i % len(DEMO_PROMPTS)] for i in range(num_prompts)]

    base, spec = [], []
    for text in tqdm(prompts, desc="demo: target-only vs DFlash", unit="prompt"):
        ids = tok(text).input_ids
        base.append(target_generate(target, ids, max_new_tokens))
        spec.append(spec_generate(target, drafter, ids, max_new_tokens))

    def rate(results) -> float:
        """Decode tokens per second, pooled over prompts (prefill excluded)."""
        tokens = sum(len(r.tokens) - 1 for r in results)
        return tokens / sum(r.total_s - r.prefill_s for r in results)

    steps = sum(r.num_steps for r in spec)
    tau = statistics.fmean(m + 1 for r in spec for m in r.accepted)
    target_rate = rate(base)
    return DemoReport(
        num_prompts=num_prompts,
        block_size=block_size,
        tokens=sum(len(r.tokens) for r in spec),
        acceptance_length=tau,
        target_tokens_per_s=target_rate,
        dflash_tokens_per_s=rate(spec),
        predicted_speedup=speedup(
            tau,
            t_target=1 / target_rate,
            t_draft=sum(r.draft_s for r in spec) / steps,
            t_verify=sum(r.verify_s for r in spec) / steps,
        ),
        lossless=all(a.tokens == b.tokens for a, b in zip(base, spec, strict=True)),
    )
