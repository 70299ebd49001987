"""Code-completion prompts cut from the standard library, per split.

    python tools/embedded_default/make_prompts.py --tokenizer build/code-target \\
        --split train --n 2000 --out build/train_prompts.jsonl
    python tools/embedded_default/make_prompts.py --tokenizer build/code-target \\
        --split held_out --n 64 --seed 1 --out build/heldout_prompts.jsonl

A prompt is the text of 32-96 tokens starting at a random line of a random file of the
split; the target continues it. Held-out prompts come only from held-out files.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

from transformers import AutoTokenizer

sys.path.insert(0, str(Path(__file__).parent))
from pretrain_target import split_files  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--tokenizer", type=Path, required=True)
    ap.add_argument("--split", choices=["train", "held_out"], required=True)
    ap.add_argument("--n", type=int, required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    tok = AutoTokenizer.from_pretrained(str(args.tokenizer))
    files = split_files()[args.split]
    rng = random.Random(args.seed)
    prompts: list[dict] = []
    while len(prompts) < args.n:
        rel, text = rng.choice(files)
        lines = text.splitlines(keepends=True)
        if len(lines) < 20:
            continue
        start = rng.randrange(len(lines) - 10)
        ids = tok("".join(lines[start : start + 40])).input_ids[: rng.randint(32, 96)]
        prompt = tok.decode(ids)
        if len(ids) < 32 or not prompt.strip():
            continue
        prompts.append({"id": f"{args.split}-{len(prompts)}", "file": rel, "prompt": prompt})
    args.out.write_text("".join(json.dumps(p) + "\n" for p in prompts))
    print(f"wrote {len(prompts)} prompts to {args.out}")


if __name__ == "__main__":
    main()
