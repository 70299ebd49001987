"""The embedded default: a tiny code-completion target and its DFlash drafter, shipped in the
package so that the demo, the benchmarks and a first `vllm serve` need no download.

Built by ``tools/embedded_default/build.sh`` (docs/training.md says how): the target is
a small Qwen3 trained on the Python standard library's own source, the drafter is trained
for it by ``vllm-dflash train`` on the target's own completions. ``heldout_prompts.jsonl``
comes from stdlib files neither model was trained on.
"""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).parent
TARGET = ROOT / "code-target"
DRAFTER = ROOT / "code-drafter-b16"
HELDOUT_PROMPTS = ROOT / "heldout_prompts.jsonl"
# The name clients send as "model" to `vllm-dflash serve-default`.
SERVED_NAME = "vllm-dflash-code"


def check_installed() -> None:
    missing = [p for p in (TARGET, DRAFTER, HELDOUT_PROMPTS) if not p.exists()]
    if missing:
        raise FileNotFoundError(
            f"embedded default incomplete, missing {[str(p) for p in missing]}; reinstall "
            "vllm-dflash or rebuild with tools/embedded_default/build.sh"
        )


def serve_args(extra: list[str] | None = None) -> list[str]:
    """``vllm serve`` arguments that serve the embedded default with DFlash at full block.

    ``extra`` comes last, so a caller's ``--served-model-name`` or ``--speculative-config``
    overrides ours (argparse keeps the last value). The CPU container runs exactly this
    (``vllm-dflash serve-default``)."""
    from vllm_dflash.config import DrafterConfig

    check_installed()
    block = DrafterConfig.from_file(DRAFTER / "config.json").block_size
    spec = {"method": "dflash", "model": str(DRAFTER), "num_speculative_tokens": block - 1}
    return [
        str(TARGET),
        "--served-model-name", SERVED_NAME,
        "--speculative-config", json.dumps(spec),
        *(extra or []),
    ]  # fmt: skip
