"""Ablations of the training recipe at equal budget on the embedded default's target.

    python tools/embedded_default/ablate.py --steps 2000 --seeds 0,1 --jobs 2 --out build/ablation

Every variant trains a drafter from the same data and number of steps once per seed, then is
evaluated greedy on the held-out prompts with the reference engine. Variants: the full recipe
(random anchors, loss decay, 5 target layers) and one change each, the three the paper
ablates: no loss decay, a fixed block grid instead of random anchors, 3 target layers instead
of 5. Prints a markdown table (mean τ over seeds, its spread, the change against the full
recipe and whether its sign is the paper's) and writes ablation.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tqdm import tqdm

B = "build/embedded"
FULL = "full recipe (random anchors, decay, 5 layers)"
# variant -> (train flags, the paper's finding for the change against the full recipe)
VARIANTS = {
    FULL: ([], ""),
    "no loss decay": (["--loss-decay", "false"], "lower (the paper's loss decay, Eq. 4)"),
    "fixed block grid (no random anchors)": (
        ["--anchors", "grid"],
        "lower (Table 9: τ 5.64 -> 4.94)",
    ),
    "3 target layers": (["--num-feature-layers", "3"], "lower (paper: τ 5.64 -> 5.38)"),
}


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def run(name: str, seed: int, args: argparse.Namespace) -> dict:
    extra = VARIANTS[name][0]
    out = args.out / f"{name.split(' (')[0].replace(' ', '-')}-seed{seed}"
    env = os.environ | {"OMP_NUM_THREADS": str(args.threads)}
    train = [sys.executable, "-m", "vllm_dflash", "train", "--target", f"{B}/code-target"]
    train += ["--data", args.data, "--eval-prompts", f"{B}/heldout_prompts.jsonl"]
    train += ["--out", str(out), "--block-size", str(args.block_size), "--num-layers"]
    train += [str(args.num_layers), "--steps", str(args.steps), "--batch-size", "8"]
    train += ["--lr", str(args.lr), "--warmup-steps", "100", "--max-seq-len", "256"]
    train += ["--eval-every", "0", "--save-every", "0", "--seed", str(seed), *extra]
    with (args.out / f"{out.name}.log").open("w") as log:
        subprocess.run(train, check=True, env=env, stdout=log, stderr=subprocess.STDOUT)
        ev = [sys.executable, "-m", "vllm_dflash", "eval", "--target", f"{B}/code-target"]
        ev += ["--draft", str(out), "--prompts", f"{B}/heldout_prompts.jsonl", "--max-tokens"]
        ev += [str(args.eval_max_tokens), "--json", str(out / "eval.json")]
        subprocess.run(ev, check=True, env=env, stdout=log, stderr=subprocess.STDOUT)
    report = json.loads((out / "eval.json").read_text())
    final_loss = json.loads((out / "train_log.json").read_text())["log"]["loss"][-50:]
    return {
        "variant": name,
        "seed": seed,
        "tau": report["acceptance_length"],
        "per_position": report["per_position"],
        "final_loss": sum(final_loss) / len(final_loss),
    }


def _spread(taus: list[float]) -> float:
    return max(taus) - min(taus)


def table(rows: list[dict], steps: int, block: int) -> str:
    """Mean over seeds, spread (max - min), and the change against the full recipe."""
    taus_of = {v: [r["tau"] for r in rows if r["variant"] == v] for v in VARIANTS}
    full, full_spread = statistics.fmean(taus_of[FULL]), _spread(taus_of[FULL])
    lines = [
        f"| variant ({steps} steps, block {block}, {len(taus_of[FULL])} seeds) | τ mean "
        "| τ spread | slot-1 acc | Δτ vs full | paper | same sign |",
        "|---|---:|---:|---:|---:|---|:---:|",
    ]
    for v, taus in taus_of.items():
        tau = statistics.fmean(taus)
        acc1 = statistics.fmean(r["per_position"][0] for r in rows if r["variant"] == v)
        delta, paper = tau - full, VARIANTS[v][1]
        # Within the seeds' spread, a change says nothing either way.
        noise = max(_spread(taus), full_spread)
        same = (
            "–" if v == FULL else ("noise" if abs(delta) <= noise else "yes" if delta < 0 else "no")
        )
        lines.append(
            f"| {v} | {tau:.3f} | {_spread(taus):.3f} | {acc1:.3f} | "
            f"{'–' if v == FULL else f'{delta:+.3f}'} | {paper or '–'} | {same} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--seeds", type=_ints, default=[0, 1], help="comma-separated, e.g. 0,1")
    ap.add_argument("--block-size", type=int, default=8)
    ap.add_argument("--num-layers", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--data", default=f"{B}/samples.jsonl")
    ap.add_argument("--eval-max-tokens", type=int, default=128)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=Path("build/ablation"))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    todo = [(v, s) for v in VARIANTS for s in args.seeds]
    with ThreadPoolExecutor(args.jobs) as pool:
        runs = pool.map(lambda vs: run(*vs, args), todo)
        rows = list(tqdm(runs, total=len(todo), desc="ablation runs", unit="run"))
    (args.out / "ablation.json").write_text(json.dumps(rows, indent=1))
    print(table(rows, args.steps, args.block_size))


if __name__ == "__main__":
    main()
