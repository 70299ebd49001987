"""Target hidden states for training, online or from disk.

Layer selection is the drafter config's ``target_layer_ids`` (the default rule when absent),
the same list serving hands to vLLM, and layer i's feature is its output (HF
``hidden_states[i+1]``), as in the reference engine.

* Online: the frozen HF target runs inside the training step, without gradients.
* Offline: ``vllm-dflash capture`` runs the target once over a sample file and writes
  features as float16/float32 ``.npy`` shards read back memory-mapped. Size is
  tokens x layers x hidden x bytes; it is printed before anything is written because it
  grows fast (1M tokens of a 4096-wide target at 5 layers in fp16 is 41 GB).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from vllm_dflash.errors import DFlashDataError
from vllm_dflash.safe_paths import file_inside

INDEX = "index.json"


@torch.no_grad()
def target_features(
    model: torch.nn.Module, ids: torch.Tensor, layers: Sequence[int]
) -> torch.Tensor:
    """[b, T] token ids -> [b, T, len(layers) * hidden] concatenated layer outputs.

    Causal attention means right padding never changes the real positions' features."""
    out = model(input_ids=ids, output_hidden_states=True, use_cache=False)
    return torch.cat([out.hidden_states[i + 1] for i in layers], dim=-1)


class OfflineFeatures:
    """Memory-mapped features written by :func:`capture`; ``get(i)`` -> [T_i, F]."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        index_file = self.root / INDEX
        if not index_file.is_file():
            raise DFlashDataError(
                f"{self.root}: no {INDEX}. Fix: write the features with `vllm-dflash capture`"
            )
        self.index = json.loads(index_file.read_text())
        self.layers: list[int] = self.index["layers"]
        self._shards = [
            np.load(
                file_inside(self.root, name, f"{index_file}: shards[{i}]", DFlashDataError),
                mmap_mode="r",
                allow_pickle=False,  # features are plain arrays; a pickled object runs code
            )
            for i, name in enumerate(self.index["shards"])
        ]

    def check(self, layers: Sequence[int], sample_ids: Sequence[str]) -> None:
        if list(layers) != self.layers:
            raise DFlashDataError(
                f"{self.root}: features were captured for target layers {self.layers}, the "
                f"drafter uses {list(layers)}. Fix: capture again with this drafter config"
            )
        missing = [i for i in sample_ids if i not in self.index["samples"]]
        if missing:
            raise DFlashDataError(
                f"{self.root}: no features for {len(missing)} sample(s) (e.g. {missing[0]!r}). "
                "Fix: capture from the same data file"
            )

    def get(self, sample_id: str) -> torch.Tensor:
        shard, start, length = self.index["samples"][sample_id]
        return torch.from_numpy(np.array(self._shards[shard][start : start + length]))  # copy


def _human(size: int) -> str:
    return f"{size / 2**30:.2f} GiB" if size >= 2**30 else f"{size / 2**20:.1f} MiB"


def capture(
    target: str | Path,
    samples: Sequence[tuple[str, list[int]]],
    layers: Sequence[int],
    out: str | Path,
    *,
    dtype: str = "float16",
    shard_tokens: int = 1 << 20,
    batch_tokens: int = 8192,
) -> Path:
    """Write features of ``samples`` [(id, token ids)] under ``out`` (one pass of the target)."""
    from transformers import AutoModelForCausalLM

    out = Path(out)
    np_dtype = np.dtype(dtype)
    model = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
    hidden = model.config.hidden_size
    total = sum(len(ids) for _, ids in samples)
    size = total * len(layers) * hidden * np_dtype.itemsize
    print(
        f"capture: {len(samples)} samples, {total} tokens x {len(layers)} layers x {hidden} "
        f"x {np_dtype.itemsize} B = {_human(size)} to {out}"
    )
    out.mkdir(parents=True, exist_ok=True)
    index: dict = {"target": str(target), "layers": list(layers), "dtype": dtype}
    index |= {"shards": [], "samples": {}}
    buf: list[np.ndarray] = []
    buf_len = 0

    def flush() -> None:
        nonlocal buf, buf_len
        if buf:
            name = f"features-{len(index['shards']):05d}.npy"
            np.save(out / name, np.concatenate(buf))
            index["shards"].append(name)
            buf, buf_len = [], 0

    order = sorted(range(len(samples)), key=lambda i: len(samples[i][1]))
    bar = tqdm(total=total, desc="capture", unit="tok", unit_scale=True)
    i = 0
    while i < len(order):
        group = [order[i]]  # similar lengths together: little padding
        longest = len(samples[order[i]][1])
        while i + len(group) < len(order):
            nxt = len(samples[order[i + len(group)]][1])
            if max(longest, nxt) * (len(group) + 1) > batch_tokens:
                break
            group.append(order[i + len(group)])
            longest = max(longest, nxt)
        i += len(group)
        ids = torch.zeros(len(group), longest, dtype=torch.long)
        for row, j in enumerate(group):
            ids[row, : len(samples[j][1])] = torch.tensor(samples[j][1])
        feats = target_features(model, ids, layers)
        for row, j in enumerate(group):
            sid, toks = samples[j]
            if buf_len + len(toks) > shard_tokens:
                flush()
            index["samples"][sid] = [len(index["shards"]), buf_len, len(toks)]
            buf.append(feats[row, : len(toks)].numpy().astype(np_dtype))
            buf_len += len(toks)
            bar.update(len(toks))
    flush()
    bar.close()
    (out / INDEX).write_text(json.dumps(index))
    return out
