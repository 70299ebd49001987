"""Ablations of the training recipe at equal budget on the embedded default's target.

    python tools/embedded_default/ablate.py --steps 600 --jobs 2 --out build/ablation

Every variant trains a block-8 drafter from the same seed, data and number of steps, then
is evaluated greedy on the held-out prompts with the reference engine. Variants: the full
recipe (random anchors, loss decay, 5 target layers) and one change each: no loss decay,
a fixed block grid instead of random anchors, 1 and 3 target layers. Prints a markdown
table and writes ablation.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

B = "build/embedded"
VARIANTS = {
    "full recipe (random anchors, decay, 5 layers)": [],
    "no loss decay": ["--loss-decay", "false"],
    "fixed block grid (no random anchors)": ["--anchors", "grid"],
    "3 target layers": ["--num-feature-layers", "3"],
    "1 target layer": ["--num-feature-layers", "1"],
}


def run(name: str, extra: list[str], args: argparse.Namespace) -> dict:
    out = args.out / name.split(" (")[0].replace(" ", "-")
    env = os.environ | {"OMP_NUM_THREADS": str(args.threads)}
    train = [sys.executable, "-m", "vllm_dflash", "train", "--target", f"{B}/code-target"]
    train += ["--data", f"{B}/samples.jsonl", "--eval-prompts", f"{B}/heldout_prompts.jsonl"]
    train += ["--out", str(out), "--block-size", "8", "--num-layers", "2", "--steps"]
    train += [str(args.steps), "--batch-size", "8", "--lr", "1e-3", "--warmup-steps", "100"]
    train += ["--max-seq-len", "256", "--eval-every", "0", "--save-every", "0", *extra]
    log = (args.out / f"{out.name}.log").open("w")
    subprocess.run(train, check=True, env=env, stdout=log, stderr=subprocess.STDOUT)
    ev = [sys.executable, "-m", "vllm_dflash", "eval", "--target", f"{B}/code-target"]
    ev += ["--draft", str(out), "--prompts", f"{B}/heldout_prompts.jsonl", "--max-tokens"]
    ev += ["128", "--json", str(out / "eval.json")]
    subprocess.run(ev, check=True, env=env, stdout=log, stderr=subprocess.STDOUT)
    report = json.loads((out / "eval.json").read_text())
    final_loss = json.loads((out / "train_log.json").read_text())["log"]["loss"][-50:]
    return {
        "variant": name,
        "tau": report["acceptance_length"],
        "per_position": report["per_position"],
        "final_loss": sum(final_loss) / len(final_loss),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=Path("build/ablation"))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    with ThreadPoolExecutor(args.jobs) as pool:
        rows = list(pool.map(lambda kv: run(*kv, args), VARIANTS.items()))
    (args.out / "ablation.json").write_text(json.dumps(rows, indent=1))
    print(f"| variant ({args.steps} steps, block 8) | tau (held-out, greedy) | slot-1 acc |")
    print("|---|---:|---:|")
    for r in rows:
        print(f"| {r['variant']} | {r['tau']:.3f} | {r['per_position'][0]:.3f} |")


if __name__ == "__main__":
    main()
