"""Load, validate and save DFlash drafter checkpoints in the z-lab format.

A checkpoint directory holds ``config.json`` (see :class:`DrafterConfig`) and
``model.safetensors`` (or a sharded ``model.safetensors.index.json``) with the keys::

    fc.weight, hidden_norm.weight, norm.weight,
    layers.N.self_attn.{q,k,v,o}_proj.weight, layers.N.self_attn.{q,k}_norm.weight,
    layers.N.mlp.{gate,up,down}_proj.weight, layers.N.{input,post_attention}_layernorm.weight

The target's embedding and LM head are shared and frozen, so they are not required;
copies some exporters include (``embed_tokens.weight``, ``lm_head.weight``) are ignored.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from vllm_dflash.config import DrafterConfig, read_json
from vllm_dflash.errors import DFlashCheckpointError
from vllm_dflash.safe_paths import file_inside

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
CONFIG_NAME = "config.json"
# Present in some exports; the drafter always uses the target's own.
IGNORED_KEYS = ("embed_tokens.weight", "lm_head.weight")


def expected_shapes(cfg: DrafterConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a drafter with this config must have, with its shape."""
    h, hd = cfg.hidden_size, cfg.resolved_head_dim
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    shapes: dict[str, tuple[int, ...]] = {
        "fc.weight": (h, cfg.feature_size),
        "hidden_norm.weight": (h,),
        "norm.weight": (h,),
    }
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "self_attn.q_norm.weight": (hd,),
            p + "self_attn.k_norm.weight": (hd,),
            p + "mlp.gate_proj.weight": (cfg.intermediate_size, h),
            p + "mlp.up_proj.weight": (cfg.intermediate_size, h),
            p + "mlp.down_proj.weight": (h, cfg.intermediate_size),
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
        }
        if cfg.attention_bias:
            shapes |= {
                p + "self_attn.q_proj.bias": (q,),
                p + "self_attn.k_proj.bias": (kv,),
                p + "self_attn.v_proj.bias": (kv,),
                p + "self_attn.o_proj.bias": (h,),
            }
    return shapes


@dataclass
class DrafterCheckpoint:
    path: Path
    config: DrafterConfig
    state_dict: dict[str, torch.Tensor]


def _load_safetensors(file: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(file))
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise DFlashCheckpointError(
            f"{file}: cannot read safetensors ({e}). The file is corrupted or truncated. "
            "Fix: re-download or re-export the checkpoint"
        ) from None


def _load_tensors(path: Path) -> dict[str, torch.Tensor]:
    if (path / WEIGHTS_NAME).is_file():
        return _load_safetensors(path / WEIGHTS_NAME)
    if (path / INDEX_NAME).is_file():
        index = read_json(path / INDEX_NAME)
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict):
            raise DFlashCheckpointError(
                f"{path / INDEX_NAME}: field 'weight_map' missing or not an object. "
                "Fix: re-export the checkpoint"
            )
        tensors: dict[str, torch.Tensor] = {}
        entry = f"{path / INDEX_NAME}: weight_map"
        files = {
            file_inside(path, shard, f"{entry}[{key!r}]", DFlashCheckpointError)
            for key, shard in weight_map.items()
        }
        for file in sorted(files):
            tensors |= _load_safetensors(file)
        return tensors
    raise DFlashCheckpointError(
        f"{path}: no {WEIGHTS_NAME} or {INDEX_NAME}. Fix: point at a directory that holds "
        "the drafter's safetensors weights"
    )


def validate_state_dict(
    cfg: DrafterConfig, tensors: dict[str, torch.Tensor], source: str
) -> dict[str, torch.Tensor]:
    """Check names, shapes and dtypes; return the tensors the drafter uses."""
    want = expected_shapes(cfg)
    tensors = {k: v for k, v in tensors.items() if k not in IGNORED_KEYS}
    problems: list[str] = []
    missing = sorted(set(want) - set(tensors))
    if missing:
        problems.append(
            f"missing keys {missing[:6]}{' ...' if len(missing) > 6 else ''} "
            f"({len(missing)} in all). Fix: the checkpoint must match config.json "
            f"(num_hidden_layers={cfg.num_hidden_layers}); re-export it"
        )
    unexpected = sorted(set(tensors) - set(want))
    if any(k in ("d2t", "t2d") for k in unexpected):
        problems.append(
            "keys 'd2t'/'t2d' declare a reduced draft vocabulary, which is not supported yet. "
            "Fix: use a drafter with the full target vocabulary"
        )
    elif unexpected:
        problems.append(
            f"unexpected keys {unexpected[:6]}{' ...' if len(unexpected) > 6 else ''}. "
            "Fix: the checkpoint must be a z-lab-format DFlash drafter with layer names "
            "like 'layers.0.self_attn.q_proj.weight' (no 'model.' prefix)"
        )
    for key, shape in want.items():
        t = tensors.get(key)
        if t is None:
            continue
        if tuple(t.shape) != shape:
            problems.append(
                f"tensor '{key}' has shape {tuple(t.shape)}, config.json implies {shape}. "
                "Fix: make config.json match the weights (hidden_size, num heads, head_dim, "
                "intermediate_size, target_layer_ids)"
            )
        elif not t.is_floating_point():
            problems.append(f"tensor '{key}' has dtype {t.dtype}; expected a float dtype")
    if problems:
        raise DFlashCheckpointError(
            f"{source}: invalid drafter checkpoint:\n  - " + "\n  - ".join(problems)
        )
    return {k: tensors[k] for k in want}


def load_drafter_checkpoint(path: str | Path) -> DrafterCheckpoint:
    """Load and validate a drafter directory; every failure is a DFlash*Error."""
    path = Path(path)
    if not path.is_dir():
        raise DFlashCheckpointError(
            f"{path}: not a directory. Fix: pass the drafter's local directory"
        )
    cfg = DrafterConfig.from_file(path / CONFIG_NAME)
    tensors = validate_state_dict(cfg, _load_tensors(path), str(path))
    return DrafterCheckpoint(path=path, config=cfg, state_dict=tensors)


def save_drafter_checkpoint(
    path: str | Path, cfg: DrafterConfig, state_dict: dict[str, torch.Tensor]
) -> Path:
    """Write ``config.json`` + ``model.safetensors`` in the z-lab layout (validated first)."""
    path = Path(path)
    tensors = validate_state_dict(
        cfg, {k: v.detach().contiguous().cpu() for k, v in state_dict.items()}, str(path)
    )
    path.mkdir(parents=True, exist_ok=True)
    (path / CONFIG_NAME).write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
    save_file(tensors, str(path / WEIGHTS_NAME), metadata={"format": "pt"})
    return path
