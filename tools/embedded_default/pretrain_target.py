"""Train the embedded default's tiny code-completion target on the Python standard library.

Every Python install carries the same corpus: the stdlib's own ``.py`` files (tests excluded).
Files are split by a hash of their relative path, so the held-out split is stable across
machines and never seen by the target, the drafter or the prompts they are trained on.

    python tools/embedded_default/pretrain_target.py --out build/code-target --minutes 25

Steps: byte-level BPE tokenizer (specials: <|endoftext|>, <|mask|>) trained on the train
split -> token stream -> a small Qwen3 causal LM trained with AdamW + cosine on random
windows. Deterministic for a given seed, Python version and thread count.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sysconfig
import time
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from tqdm import tqdm
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

EOS, MASK = "<|endoftext|>", "<|mask|>"
HELD_OUT_PERCENT = 10


def stdlib_files() -> tuple[Path, list[Path]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "test", "tests", "idle_test", "__pycache__"}
    files = sorted(f for f in root.rglob("*.py") if not skip & set(f.relative_to(root).parts))
    return root, files


def is_held_out(rel: str) -> bool:
    return int(hashlib.sha256(rel.encode()).hexdigest(), 16) % 100 < HELD_OUT_PERCENT


def split_files() -> dict[str, list[tuple[str, str]]]:
    """{"train": [(relative path, text)], "held_out": [...]}; unreadable files are skipped."""
    root, files = stdlib_files()
    out: dict[str, list[tuple[str, str]]] = {"train": [], "held_out": []}
    for f in files:
        rel = f.relative_to(root).as_posix()
        try:
            text = f.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        out["held_out" if is_held_out(rel) else "train"].append((rel, text))
    return out


def train_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS, MASK],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS, pad_token=EOS, mask_token=MASK
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--vocab-size", type=int, default=2048)
    ap.add_argument("--hidden-size", type=int, default=192)
    ap.add_argument("--intermediate-size", type=int, default=576)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--minutes", type=float, default=None, help="stop early after this long")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    args.out.mkdir(parents=True, exist_ok=True)

    split = split_files()
    train_texts = [t for _, t in split["train"]]
    tok = train_tokenizer(train_texts, args.vocab_size)
    tok.save_pretrained(args.out)
    (args.out / "held_out_files.json").write_text(
        json.dumps([rel for rel, _ in split["held_out"]], indent=1)
    )
    eos = tok.convert_tokens_to_ids(EOS)
    stream = []
    for text in tqdm(train_texts, desc="tokenize", unit="file"):
        stream += tok(text).input_ids + [eos]
    data = torch.tensor(np.asarray(stream, dtype=np.int64))
    print(
        f"{len(split['train'])} train files, {len(data)} tokens; "
        f"{len(split['held_out'])} held-out files"
    )

    cfg = Qwen3Config(
        vocab_size=len(tok),
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden_size // 32,
        num_key_value_heads=max(1, args.hidden_size // 96),
        head_dim=32,  # vLLM's CPU attention needs head sizes >= 32
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        eos_token_id=eos,
        bos_token_id=eos,
        pad_token_id=eos,
    )
    model = Qwen3ForCausalLM(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"target: {n_params / 1e6:.2f} M parameters")
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95))
    warmup = 100

    def lr_at(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warmup) / (args.steps - warmup)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    gen = torch.Generator().manual_seed(args.seed)
    start, log = time.time(), []
    bar = tqdm(range(args.steps), desc="pretrain target", unit="step")
    for step in bar:
        idx = torch.randint(0, len(data) - args.seq_len, (args.batch,), generator=gen)
        batch = torch.stack([data[i : i + args.seq_len] for i in idx.tolist()])
        loss = model(input_ids=batch, labels=batch).loss  # HF shifts the labels itself
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        log.append(loss.item())
        bar.set_postfix(loss=f"{sum(log[-20:]) / len(log[-20:]):.3f}")
        if args.minutes and time.time() - start > 60 * args.minutes:
            print(f"time budget reached after {step + 1} steps")
            break
    model.eval()
    model.to(torch.bfloat16).save_pretrained(args.out)
    (args.out / "pretrain_log.json").write_text(
        json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "loss": log})
    )
    print(f"saved {args.out} (last-20 mean loss {sum(log[-20:]) / 20:.3f})")


if __name__ == "__main__":
    main()
