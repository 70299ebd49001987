#!/usr/bin/env bash
# Rebuild the embedded default (vllm_dflash/assets/) from nothing but the Python 3.11
# standard library. About 3 h on 2 CPU cores (target 0.5 h, gen-data 0.2 h, drafter
# 12000 steps 1.7 h, then 2500 steps on blocks of 8 and 16 0.5 h); every step is seeded.
#
#   tools/embedded_default/build.sh            # then review and commit vllm_dflash/assets/
#
# Steps: tokenizer + target pretraining -> prompts per split -> the target's own greedy
# completions through vLLM (gen-data) -> drafter training (drafter.toml) -> held-out eval
# -> copy into the package. Ablations: tools/embedded_default/ablate.py.
set -euo pipefail
cd "$(dirname "$0")/../.."
B=build/embedded
PY=${PY:-.venv/bin/python}
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
mkdir -p "$B"

[ -f "$B/code-target/config.json" ] ||
    $PY tools/embedded_default/pretrain_target.py --out "$B/code-target" --steps 1500
$PY tools/embedded_default/make_prompts.py --tokenizer "$B/code-target" --split train \
    --n 24000 --seed 7 --out "$B/train_prompts.jsonl"
$PY tools/embedded_default/make_prompts.py --tokenizer "$B/code-target" --split held_out \
    --n 64 --seed 1 --out "$B/heldout_prompts.jsonl"
$PY -m vllm_dflash gen-data --target "$B/code-target" --prompts "$B/train_prompts.jsonl" \
    --out "$B/samples.jsonl" --max-tokens 128 --max-model-len 512 --dtype float32 --chunk 2000
$PY -m vllm_dflash train --config tools/embedded_default/drafter.toml
# stage 2: blocks of 8 and 16 alike, so that K = 7 keeps its acceptance
$PY -m vllm_dflash train --config tools/embedded_default/drafter-short-blocks.toml
for b in 16 8; do
    $PY -m vllm_dflash eval --target "$B/code-target" --draft "$B/code-drafter-b16-short" \
        --prompts "$B/heldout_prompts.jsonl" --block-size $b --max-tokens 128 \
        --json "$B/eval-b$b.json"
done

A=vllm_dflash/assets
rm -rf "$A/code-target" "$A/code-drafter-b16"
mkdir -p "$A/code-target" "$A/code-drafter-b16"
cp "$B"/code-target/{config.json,generation_config.json,model.safetensors,tokenizer.json,tokenizer_config.json} \
    "$A/code-target/"
cp "$B"/code-drafter-b16-short/{config.json,model.safetensors} "$A/code-drafter-b16/"
cp "$B/heldout_prompts.jsonl" "$A/"
cp "$B/code-drafter-b16/training.png" docs/embedded-default-training.png  # the τ-vs-steps curve
du -sh "$A"
