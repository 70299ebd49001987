"""`make demo`: the embedded default served by real vLLM, with and without DFlash.

Two engines (our plugin's ``dflash`` and no speculation) serve the same held-out
code-completion prompts, greedy, timed in interleaved passes after a warm-up (the
benchmark's machinery, bench/compare_backends.py). Every number printed is measured:
acceptance length from vLLM's own spec-decode counters, tokens/s of each engine, their
paired ratio, and whether the DFlash outputs equal the no-speculation outputs.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

from vllm_dflash import assets
from vllm_dflash.bench.compare_backends import Row, compare, measure
from vllm_dflash.config import DrafterConfig


@dataclass
class DemoReport:
    num_prompts: int
    max_tokens: int
    k: int
    dflash: Row
    none: Row
    prompt: str
    completion: str

    def table(self) -> str:
        rows = [
            ("held-out prompts x max tokens", f"{self.num_prompts} x {self.max_tokens}"),
            ("draft tokens per step (K)", str(self.k)),
            ("acceptance length tau", f"{self.dflash.acceptance_length:.2f}"),
            ("no speculation, output tok/s", f"{self.none.tokens_per_s:.1f}"),
            ("DFlash (vllm-dflash), output tok/s", f"{self.dflash.tokens_per_s:.1f}"),
            ("speedup (paired passes)", f"{self.dflash.speedup_vs_none:.2f}x"),
            ("outputs identical (greedy)", "yes" if self.dflash.matches_none else "NO"),
        ]
        w = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{w}}  {v}" for k, v in rows)


def run_demo(
    workdir: str | Path | None = None,
    num_prompts: int = 16,
    max_tokens: int = 64,
    concurrency: int = 1,
    repeats: int = 3,
    k: int | None = None,
) -> DemoReport:
    from transformers import AutoTokenizer

    assets.check_installed()
    workdir = Path(workdir or tempfile.mkdtemp(prefix="vllm-dflash-demo-"))
    workdir.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(assets.TARGET)
    lines = assets.HELDOUT_PROMPTS.read_text().splitlines()[:num_prompts]
    texts = [json.loads(line)["prompt"] for line in lines]
    prompts = [tok(t).input_ids for t in texts]
    block = DrafterConfig.from_file(assets.DRAFTER / "config.json").block_size
    args = argparse.Namespace(
        target=assets.TARGET,
        draft=assets.DRAFTER,
        k=k or block - 1,
        max_tokens=max_tokens,
        repeats=repeats,
        concurrency=[concurrency],
    )
    backends = ("dflash", "none")
    passes = measure(args, prompts, workdir, backends)
    rows = {r.backend: r for r in compare(passes, [concurrency], backends)}
    first = passes[("dflash", concurrency)][0].outputs[0]
    return DemoReport(
        num_prompts=len(prompts),
        max_tokens=max_tokens,
        k=args.k,
        dflash=rows["dflash"],
        none=rows["none"],
        prompt=texts[0],
        completion=tok.decode(first, skip_special_tokens=True),
    )
