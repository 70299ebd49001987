"""Acceptance length of a drafter on prompts, with the reference engine (no vLLM needed).

``vllm-dflash eval --target T --draft D --prompts P --block-size B --json out.json``

Greedy by default: tau is then a property of (target, drafter, prompts) alone, and it is
what the trainer's periodic eval reports. Per-position acceptance is cumulative (slot k
counts steps whose slots 1..k were all accepted), the convention of vLLM's counters.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from tqdm import tqdm

from vllm_dflash.reference.drafter import ReferenceDrafter
from vllm_dflash.reference.generate import spec_generate
from vllm_dflash.reference.target import HFTarget


@dataclass
class AcceptanceReport:
    block_size: int
    num_prompts: int
    num_steps: int
    tokens: int
    acceptance_length: float
    per_position: list[float]  # cumulative acceptance rate of draft slot 1..B-1

    def table(self) -> str:
        pos = " ".join(f"{p:.2f}" for p in self.per_position)
        return (
            f"block size {self.block_size}: tau = {self.acceptance_length:.3f} over "
            f"{self.num_steps} steps ({self.num_prompts} prompts, {self.tokens} tokens)\n"
            f"per-position acceptance (slot 1..{self.block_size - 1}): {pos}"
        )


def measure(
    target: HFTarget,
    drafter: ReferenceDrafter,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    stop_token_ids: Sequence[int] = (),
    progress: bool = False,
) -> AcceptanceReport:
    accepted: list[int] = []
    tokens = 0
    for ids in tqdm(prompts, desc="eval", unit="prompt", disable=not progress):
        res = spec_generate(target, drafter, ids, max_new_tokens, stop_token_ids=stop_token_ids)
        accepted += res.accepted
        tokens += len(res.tokens)
    g = drafter.block_size - 1
    n = max(1, len(accepted))
    return AcceptanceReport(
        block_size=drafter.block_size,
        num_prompts=len(prompts),
        num_steps=len(accepted),
        tokens=tokens,
        acceptance_length=sum(m + 1 for m in accepted) / n,
        per_position=[sum(m >= k for m in accepted) / n for k in range(1, g + 1)],
    )


def evaluate(
    target_dir: str | Path,
    draft_dir: str | Path,
    prompts_path: str | Path,
    *,
    block_size: int | None = None,
    max_new_tokens: int = 128,
    num_prompts: int | None = None,
    strict: bool = False,
    json_out: str | Path | None = None,
    enable_thinking: bool | None = None,
) -> AcceptanceReport:
    from transformers import AutoTokenizer

    from vllm_dflash.data import prompt_format
    from vllm_dflash.data.records import encode_prompt, read_prompts

    tok = AutoTokenizer.from_pretrained(str(target_dir))
    records = read_prompts(prompts_path, strict=strict)[:num_prompts]
    prompts = [encode_prompt(tok, r.data, enable_thinking) for r in records]
    evaluated = {prompt_format.of(tok, r.data, enable_thinking) for r in records}
    if warning := prompt_format.mismatch(Path(draft_dir), evaluated):
        print(f"warning: {warning}", file=sys.stderr)
    target = HFTarget.from_pretrained(target_dir)
    drafter = ReferenceDrafter.load(draft_dir, target, block_size)
    stop = [tok.eos_token_id] if tok.eos_token_id is not None else []
    report = measure(target, drafter, prompts, max_new_tokens, stop, progress=True)
    if json_out:
        Path(json_out).write_text(
            json.dumps(
                asdict(report) | {"target": str(target_dir), "draft": str(draft_dir)}, indent=2
            )
        )
    return report
