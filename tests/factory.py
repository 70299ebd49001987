"""Tiny, seeded Qwen3 targets and z-lab-format DFlash drafters built on disk.

Nothing is downloaded: the tokenizer is character-level and built here, the weights are
random but deterministic for a given seed. The tests build every model they run from here.
"""

from __future__ import annotations

import json
import string
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from vllm_dflash.checkpoint import save_drafter_checkpoint
from vllm_dflash.reference.model import DFlashDrafter
from vllm_dflash.train.drafter_init import new_drafter_config

EOS = "<|endoftext|>"
UNK = "<|unk|>"
MASK = "<|mask|>"
# Most frequent characters of English text and code first, so tiny vocabularies stay useful.
_CHARS = (
    " etaoinsrhldcumfpgwybvkxjqz\n_().,:=ETAOINSRHLDCUMFPGWYBVKXJQZ0123456789"
    "'\"[]{}#+-*/<>!?;@%&|\\^`~$\t"
)
assert len(set(_CHARS)) == len(_CHARS)
assert set(string.printable) - set(_CHARS) <= {"\r", "\x0b", "\x0c"}


def build_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """Character-level tokenizer: ids 0/1 are EOS/UNK, the last id is the DFlash <mask>."""
    if vocab_size < 4:
        raise ValueError(f"vocab_size={vocab_size}: need at least 4 (EOS, UNK, a char, MASK)")
    n_chars = min(len(_CHARS), vocab_size - 3)
    pieces = [EOS, UNK, *_CHARS[:n_chars]]
    pieces += [f"<|extra_{i}|>" for i in range(vocab_size - 1 - len(pieces))] + [MASK]
    vocab = {p: i for i, p in enumerate(pieces)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    special = [EOS, UNK, MASK] + [p for p in pieces if p.startswith("<|extra_")]
    tok.add_special_tokens(special)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS, unk_token=UNK, pad_token=EOS, mask_token=MASK
    )


_ARCHITECTURES = {
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
    "llama": (LlamaConfig, LlamaForCausalLM),
}


def make_target(
    out: str | Path,
    *,
    vocab_size: int = 128,
    hidden_size: int = 64,
    num_layers: int = 8,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 32,  # vLLM's CPU attention supports head sizes >= 32
    intermediate_size: int = 128,
    init_std: float = 0.1,
    seed: int = 0,
    architecture: str = "qwen3",
) -> Path:
    """A random Qwen3 (or Llama) causal LM + tokenizer saved with ``save_pretrained``."""
    out = Path(out)
    tokenizer = build_tokenizer(vocab_size)
    config_cls, model_cls = _ARCHITECTURES[architecture]
    cfg = config_cls(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=4096,
        initializer_range=init_std,
        tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = model_cls(cfg).eval()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def make_drafter(
    out: str | Path,
    target_dir: str | Path,
    *,
    block_size: int = 8,
    num_layers: int = 2,
    target_layer_ids: list[int] | None = None,
    intermediate_size: int | None = None,
    init_std: float = 0.1,
    seed: int = 1,
) -> Path:
    """A random DFlash drafter for ``target_dir`` in the z-lab checkpoint format."""
    target = json.loads((Path(target_dir) / "config.json").read_text())
    layers = target["num_hidden_layers"]
    cfg = new_drafter_config(
        target,
        block_size=block_size,
        num_layers=num_layers,
        num_feature_layers=min(num_layers, layers - 3),
        target_layer_ids=target_layer_ids,
        intermediate_size=intermediate_size,
    )
    torch.manual_seed(seed)
    model = DFlashDrafter(cfg)
    for name, p in model.named_parameters():
        if "norm" not in name:
            torch.nn.init.normal_(p, std=init_std)
    return save_drafter_checkpoint(out, cfg, model.state_dict())
