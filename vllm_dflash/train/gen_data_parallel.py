"""``gen-data --data-parallel-size N``: N engines on this machine from one command.

Each engine is its own ``gen-data`` process for one shard (``--num-shards N --shard-index
I``), so it writes and resumes ``OUT/shard-I-of-N.jsonl`` exactly as a hand-started shard
would; this parent only gives each its own devices, keeps its output in
``OUT/logs/shard-I.log`` and shows one progress bar over all of them. Processes rather than
vLLM's own data parallelism because a shard that dies (out of memory, a bad node) then costs
its own shard's unfinished chunk and nothing else: rerunning the command resumes every shard.

Devices: with CUDA, engine I gets the I-th group of ``--tensor-parallel-size`` devices of
``CUDA_VISIBLE_DEVICES`` (or of all devices); on vLLM's CPU build, an equal share of this
process's cores (``VLLM_CPU_OMP_THREADS_BIND``, one share per tensor-parallel rank).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from vllm_dflash.data.records import read_prompts
from vllm_dflash.errors import DFlashConfigError
from vllm_dflash.train.gen_data import shard_path, write_stats


def engine_envs(n: int, tp: int, env: Mapping[str, str]) -> list[dict[str, str]]:
    """Per engine, the environment variables that give it its own devices."""
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        devices = [d.strip() for d in visible.split(",") if d.strip()]
    else:
        import torch

        devices = [str(i) for i in range(torch.cuda.device_count())]
    if devices:
        if len(devices) < n * tp:
            raise DFlashConfigError(
                f"--data-parallel-size {n} x --tensor-parallel-size {tp} needs {n * tp} "
                f"GPUs, {len(devices)} are visible ({','.join(devices)}). Fix: lower either, "
                "or set CUDA_VISIBLE_DEVICES"
            )
        return [
            {"CUDA_VISIBLE_DEVICES": ",".join(devices[i * tp : (i + 1) * tp])} for i in range(n)
        ]
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < n * tp:
        raise DFlashConfigError(
            f"--data-parallel-size {n} x --tensor-parallel-size {tp} needs {n * tp} CPU cores "
            f"(one per rank), this process may use {len(cores)}. Fix: lower either"
        )
    share = len(cores) // (n * tp)
    ranks = [cores[r * share : (r + 1) * share] for r in range(n * tp)]
    return [
        {
            "VLLM_CPU_OMP_THREADS_BIND": "|".join(
                ",".join(map(str, c)) for c in ranks[i * tp : (i + 1) * tp]
            )
        }
        for i in range(n)
    ]


@dataclass
class _ShardFile:
    """Counts the complete lines a shard's engine appends, reading only what is new."""

    path: Path
    offset: int = 0  # just past the last complete line read
    lines: int = 0
    tokens: int = 0  # response tokens of lines read after start()
    _counting: bool = field(default=False, repr=False)

    def poll(self) -> int:
        """Lines completed since the last poll."""
        if not self.path.is_file():
            return 0
        with self.path.open("rb") as f:
            f.seek(self.offset)
            new = f.read()
        end = new.rfind(b"\n") + 1
        got = new[:end].splitlines()
        self.offset += end
        self.lines += len(got)
        if self._counting:
            self.tokens += sum(len(json.loads(line).get("response_token_ids", ())) for line in got)
        return len(got)

    def start(self) -> None:
        """What is there now was written before this run: count lines, not tokens."""
        self.poll()
        self._counting = True


def generation_window(stats: Sequence[dict]) -> tuple[float, float] | None:
    """(start, end): from the moment the first engine began generating to the moment the
    last one finished, over the shards' ``gen_data.write_stats`` records. The engines'
    start-up is left out, as a single engine's own rate leaves it out (None: nothing was
    generated)."""
    ran = [s for s in stats if s.get("start") is not None and s.get("end") is not None]
    if not ran:
        return None
    return min(s["start"] for s in ran), max(s["end"] for s in ran)


def _read_stats(path: Path) -> dict:
    """A shard's stats, or an empty record for a shard that wrote none (it died first)."""
    try:
        return json.loads(path.read_text())
    except OSError:
        return {}
    except ValueError as e:
        print(
            f"gen-data: {path} is not valid JSON ({e}); its shard is left out of the rate",
            file=sys.stderr,
        )
        return {}


def run(
    child_argv: Sequence[str],
    prompts: Path,
    out: Path,
    n: int,
    tp: int,
    stats_file: Path | None = None,
) -> int:
    """Run ``n`` shard engines of ``vllm-dflash gen-data <child_argv>``; 0 when all finish."""
    envs = engine_envs(n, tp, os.environ)
    total = len(read_prompts(prompts))  # the engines check the lines again, with the tokenizer
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    shards = [_ShardFile(shard_path(out, n, i)) for i in range(n)]
    stats_paths = [logs / f"shard-{i}.stats.json" for i in range(n)]
    procs: list[subprocess.Popen] = []
    try:
        for i, extra in enumerate(envs):
            shards[i].start()
            cmd = [sys.executable, "-m", "vllm_dflash", "gen-data", *child_argv]
            cmd += ["--num-shards", str(n), "--shard-index", str(i)]
            stats_paths[i].unlink(missing_ok=True)
            cmd += ["--stats-file", str(stats_paths[i])]
            with (logs / f"shard-{i}.log").open("w") as log:
                procs.append(
                    subprocess.Popen(
                        cmd, stdout=log, stderr=subprocess.STDOUT, env=os.environ | extra
                    )
                )
            print(f"gen-data: engine {i}: {' '.join(f'{k}={v}' for k, v in extra.items())}")
        start = time.perf_counter()
        bar = tqdm(
            total=total, initial=sum(s.lines for s in shards), desc="gen-data", unit="prompt"
        )
        while True:
            running = [p for p in procs if p.poll() is None]
            bar.update(sum(s.poll() for s in shards))
            tokens = sum(s.tokens for s in shards)
            bar.set_postfix(
                engines=len(running), tok_s=f"{tokens / (time.perf_counter() - start):.0f}"
            )
            if not running:
                break
            time.sleep(1.0)
        bar.close()
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            p.wait()
    took = time.perf_counter() - start
    tokens = sum(s.tokens for s in shards)
    stats = [_read_stats(path) for path in stats_paths]
    window = generation_window(stats)
    span = window[1] - window[0] if window else None
    # Over the engines that reported their time: a shard that died leaves its finished
    # chunks in the files (and in ``tokens``) but no span to divide them by.
    generated = sum(s.get("tokens", 0) for s in stats)
    rate = f"; generating {span:.1f} s, {generated / span:.0f} tokens/s" if span else ""
    print(
        f"gen-data: {n} engines, {sum(s.lines for s in shards)} of {total} prompts in {out}; "
        f"{tokens} new response tokens in {took:.1f} s with the engines' start "
        f"({tokens / took:.0f} tokens/s){rate}"
    )
    if stats_file is not None:
        write_stats(
            stats_file,
            sum(s.get("prompts", 0) for s in stats),
            generated,
            *(window or (None, None)),
        )
    failed = [i for i, p in enumerate(procs) if p.returncode != 0]
    for i in failed:
        tail = (logs / f"shard-{i}.log").read_text(errors="replace").splitlines()[-15:]
        print(
            f"gen-data: engine {i} exited {procs[i].returncode}; the end of its log:",
            file=sys.stderr,
        )
        print("\n".join("    " + line for line in tail), file=sys.stderr)
    if failed:
        print(
            f"gen-data: {len(failed)} of {n} shards failed (logs in {logs}). Rerun the same "
            "command: every shard resumes where it stopped",
            file=sys.stderr,
        )
        return 1
    return 0
