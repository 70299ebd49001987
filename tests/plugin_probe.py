"""What loading our plugin, then building an engine configuration, changes in vLLM:
``python tests/plugin_probe.py '{"engine": {...EngineArgs...} | null}'`` prints one JSON
line. Run in a fresh process per case (tests/test_plugin_decision.py)."""

from __future__ import annotations

import json
import logging
import sys


def main(request: dict) -> dict:
    logging.basicConfig(level=logging.INFO)
    from vllm_dflash.serving.seams import snapshot
    from vllm_dflash.serving.seams.environment import installed

    version = installed().version
    assert version is not None
    before = snapshot(version)  # imports every seam's module first

    from vllm.plugins import load_general_plugins

    from vllm_dflash.serving.seams import patch

    load_general_plugins()
    out: dict = {"after_plugins": _diff(before, snapshot(version)), "changes": patch.changed()}
    if request.get("engine") is not None:
        from vllm.engine.arg_utils import EngineArgs

        EngineArgs(**request["engine"]).create_engine_config()
        out["after_config"] = _diff(before, snapshot(version))
        out["changes_after_config"] = patch.changed()
        import vllm.v1.worker.gpu_model_runner as runner

        out["proposer"] = runner.DFlashProposer.__module__
    return out


def _diff(a: dict[str, int], b: dict[str, int]) -> list[str]:
    return sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))


if __name__ == "__main__":
    print("PROBE " + json.dumps(main(json.loads(sys.argv[1]))), flush=True)
