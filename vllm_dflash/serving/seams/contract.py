"""Checks every seam against the vLLM importable in this process:
``python -m vllm_dflash.serving.seams.contract [--expect VERSION]`` prints one JSON line
(``CONTRACT {...}``) and exits 1 when anything is off.

Run by ``tests/test_vllm_contracts.py`` against the python sources of each supported GPU
release (no GPU needed: vLLM's python imports without its compiled parts), and usable
against any installed vLLM. It checks that

1. every seam exists where ``SEAMS`` says (and is gone where it says so), with the
   parameters, members and fields we rely on;
2. our modules import: the drafter, the runner-V2 speculator, the V1 proposer where V1 is;
3. the draft-model interface: every attribute the release's runner-V2 DFlash speculator
   reads or calls on its draft model is one we list (``DRAFT_MODEL_CALLS`` /
   ``DRAFT_MODEL_OPTIONAL``), and our drafter implements each listed one with the
   parameters vLLM's own DFlash drafter has;
4. the plugin's choice on forced runner V1 / V2 configurations (vLLM's own
   ``use_v2_model_runner``), and that serving builds our proposer or speculator there: V1's
   proposer name, 0.32 / 0.33's ``init_speculator``, 0.34's declared speculator config
   resolved by vLLM's own ``get_speculator_config_class``; then that ``restore_all``
   leaves every seam exactly as it was;
5. the behaviours the draft policy's route on runner V2 relies on (``BEHAVIOURS``): found
   in vLLM's source where listed, and not all found where not (a release that gains one
   turns the check red until its versions are updated).
"""

from __future__ import annotations

import argparse
import ast
import importlib
import inspect
import json
import os
import re
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from vllm_dflash.serving.seams import (
    BEHAVIOURS,
    DRAFT_MODEL_CALLS,
    DRAFT_MODEL_OPTIONAL,
    SEAMS,
    Behaviour,
    Seam,
    resolve,
    snapshot,
)

# Where runner V2's DFlash speculator touches its draft model, and the names it uses for it.
SPECULATOR_FILES = (
    "v1/worker/gpu/spec_decode/dflash/speculator.py",
    "v1/worker/gpu/spec_decode/dflash/utils.py",
    "v1/worker/gpu/spec_decode/speculator.py",
)
DRAFT_NAMES = ("dflash_model",)  # plus self.model
VLLM_DRAFTER = ("vllm.model_executor.models.qwen3_dflash", "DFlashQwen3ForCausalLM")


def check(version: str) -> list[str]:
    problems: list[str] = []
    for s in SEAMS.values():
        problems += _check_seam(s, version)
    problems += _check_imports(version)
    problems += _check_draft_model_calls()
    problems += _check_choices(version)
    for b in BEHAVIOURS.values():
        problems += _check_behaviour(b, version)
    return problems


# ---- 1. seams ---------------------------------------------------------------------------
def _check_seam(s: Seam, version: str) -> list[str]:
    try:
        obj = resolve(s.name)
    except (ImportError, AttributeError) as e:
        if version in s.versions:
            return [f"seam {s.name}: {s.module}.{s.attr} is missing ({e})"]
        return []
    if version not in s.versions:
        return [f"seam {s.name}: {s.module}.{s.attr} exists in {version}; update its versions"]
    out = []
    if s.params is not None:
        out += _check_params(s.name, obj, s.params)
    if s.keywords:
        accepted = set(inspect.signature(obj).parameters)
        missing_kw = [k for k in s.keywords if k not in accepted]
        if missing_kw:
            out.append(f"seam {s.name}: does not accept {missing_kw}")
    for member, params in s.members:
        fn = getattr(obj, member, None)
        if fn is None:
            out.append(f"seam {s.name}: no member {member}")
        else:
            out += _check_params(f"{s.name}.{member}", fn, params)
    missing = [f for f in s.fields if not _has_field(obj, f)]
    if missing:
        out.append(f"seam {s.name}: no field(s) {missing}")
    return out


def _check_params(where: str, fn: Any, expected: tuple[str, ...]) -> list[str]:
    try:
        params = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return [f"seam {where}: no inspectable signature"]
    if params and params[0] in ("self", "cls"):
        params = params[1:]
    if params[: len(expected)] != list(expected):
        return [f"seam {where}: parameters {params}, expected to start with {list(expected)}"]
    return []


def _has_field(obj: Any, name: str) -> bool:
    if name in getattr(obj, "__dataclass_fields__", {}) or hasattr(obj, name):
        return True
    # Instance attributes: assigned as self.<name> somewhere in the class or its bases.
    for cls in getattr(obj, "__mro__", ()):
        try:
            tree = ast.parse(inspect.getsource(cls))
        except (OSError, TypeError, SyntaxError):
            continue
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and node.attr == name
                and isinstance(node.ctx, ast.Store)
                and isinstance(node.value, ast.Name)
                and node.value.id == "self"
            ):
                return True
            if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", None) == name:
                return True
    return False


def _check_behaviour(b: Behaviour, version: str) -> list[str]:
    """Each of ``b.patterns`` in the normalised source of ``b.module``.``b.attr``."""
    try:
        obj: Any = importlib.import_module(b.module)
        for part in b.attr.split("."):
            obj = getattr(obj, part)
        source = ast.unparse(ast.parse(textwrap.dedent(inspect.getsource(obj))))
    except (ImportError, AttributeError, OSError, TypeError) as e:
        if version not in b.versions:  # gone in this release (runner V1 in 0.34)
            return []
        return [f"behaviour {b.name}: {b.module}.{b.attr} cannot be read ({e})"]
    missing = [p for p in b.patterns if not re.search(p, source)]
    if version in b.versions and missing:
        return [f"behaviour {b.name} ({b.why}): {b.attr} no longer matches {missing}"]
    if version not in b.versions and not missing:
        return [f"behaviour {b.name}: {b.attr} in {version} does it too; update its versions"]
    return []


# ---- 2. our modules ---------------------------------------------------------------------
def _check_imports(version: str) -> list[str]:
    modules = ["vllm_dflash.serving.drafter_model", "vllm_dflash.serving.v2.speculator"]
    if version in SEAMS["v1.proposer_base"].versions:
        modules.append("vllm_dflash.serving.proposer")
    out = []
    for m in modules:
        try:
            __import__(m)
        except Exception as e:  # noqa: BLE001 - any failure is the finding
            out.append(f"import {m}: {type(e).__name__}: {e}")
    return out


# ---- 3. the draft-model interface -------------------------------------------------------
def draft_model_uses(vllm_root: Path) -> dict[str, list[str]]:
    """Name -> where: every attribute runner V2's DFlash speculator reads or calls on its
    draft model (``self.model.X``, ``dflash_model.X``, getattr/hasattr with a literal name;
    calling the model itself is ``forward``)."""
    uses: dict[str, list[str]] = {}
    for rel in SPECULATOR_FILES:
        path = vllm_root / rel
        for node in ast.walk(ast.parse(path.read_text())):
            name = None
            if isinstance(node, ast.Attribute) and _is_draft(node.value):
                name = node.attr
            elif isinstance(node, ast.Call):
                f = node.func
                if _is_draft(f):
                    name = "forward"
                elif (
                    isinstance(f, ast.Name)
                    and f.id in ("getattr", "hasattr")
                    and len(node.args) >= 2
                    and _is_draft(node.args[0])
                    and isinstance(node.args[1], ast.Constant)
                ):
                    name = node.args[1].value
            if name and not name.startswith("__"):
                uses.setdefault(name, []).append(f"{rel}:{node.lineno}")
    return uses


def _is_draft(node: ast.AST) -> bool:
    if isinstance(node, ast.Name):
        return node.id in DRAFT_NAMES
    return (
        isinstance(node, ast.Attribute)
        and node.attr == "model"
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
    )


def _check_draft_model_calls() -> list[str]:
    import vllm

    from vllm_dflash.serving.drafter_model import DFlashDraftModel

    out = []
    uses = draft_model_uses(Path(vllm.__file__).parent)
    for name, where in sorted(uses.items()):
        if name not in DRAFT_MODEL_CALLS and name not in DRAFT_MODEL_OPTIONAL:
            out.append(f"runner V2 uses draft_model.{name} ({where[0]}), not in our seam table")
    theirs_cls = getattr(__import__(VLLM_DRAFTER[0], fromlist=["x"]), VLLM_DRAFTER[1])
    init = inspect.getsource(DFlashDraftModel.__init__)
    for name, params in DRAFT_MODEL_CALLS.items():
        if not params:  # an attribute: set in __init__
            if not re.search(rf"self\.{name}\b[^=\n]*=", init):
                out.append(f"our drafter does not set `{name}`")
            continue
        ours = getattr(DFlashDraftModel, name, None)
        if ours is None:
            out.append(f"our drafter lacks {name}")
            continue
        ours_params = list(inspect.signature(ours).parameters)[1:]
        if ours_params != list(params):
            out.append(f"our drafter's {name}{tuple(ours_params)}: expected {params}")
        theirs = getattr(theirs_cls, name, None)
        if theirs is not None:
            theirs_params = list(inspect.signature(theirs).parameters)[1:]
            if len(theirs_params) != len(ours_params) or (
                name == "forward" and theirs_params != ours_params
            ):
                out.append(f"{name}: vLLM's drafter takes {theirs_params}, ours {ours_params}")
    precompute = inspect.signature(DFlashDraftModel.precompute_and_store_context_kv)
    if list(precompute.parameters.values())[-1].default is not None:
        out.append("precompute_and_store_context_kv: the slots must default to None")
    return out


# ---- 4. the plugin's choices ------------------------------------------------------------
def _check_choices(version: str) -> list[str]:
    from vllm_dflash.serving import install
    from vllm_dflash.serving.seams import patch
    from vllm_dflash.serving.seams.decide import Backend, Installed, for_config
    from vllm_dflash.serving.seams.environment import runner_of

    out = []
    before = snapshot(version)
    v1 = version in SEAMS["config.use_v2_model_runner"].versions
    for forced in ("0", "1") if v1 else ("1",):
        runner = runner_of(_config_stub(forced, v1))
        expected = "v2" if forced == "1" else "v1"
        if runner != expected:
            out.append(f"VLLM_USE_V2_MODEL_RUNNER={forced}: runner {runner}, not {expected}")
            continue
        d = for_config(Installed("vllm", version, "cuda"), Backend(), "dflash", runner)
        if not d.serve:
            out.append(f"{version} runner {runner}: the plugin stands aside ({d.why})")
            continue
        install.install(runner)
        out += _check_built_ours(version, runner)
        patch.restore_all()
        after = snapshot(version)
        changed = sorted(k for k in before if before[k] != after.get(k))
        if changed:
            out.append(f"runner {runner}: restore_all left {changed} changed")
    return out


def _config_stub(use_v2: str, has_choice: bool) -> Any:
    """A configuration for which vLLM's own ``use_v2_model_runner`` (0.32 / 0.33; 0.34
    has only V2, ``has_choice`` False) answers from ``VLLM_USE_V2_MODEL_RUNNER``, as a user
    forces it."""
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = use_v2
    prop = {"use_v2_model_runner": resolve("config.use_v2_model_runner")} if has_choice else {}
    stub = type("VllmConfigStub", (), prop)()
    stub.attention_config = SimpleNamespace(hisparse_config=None)
    stub.watermark_config = None
    return stub


def resolve_class(module: str, name: str) -> Any:
    return getattr(__import__(module, fromlist=[name]), name)


def _check_built_ours(version: str, runner: str) -> list[str]:
    from vllm_dflash.serving.install import DRAFTER_ARCH, DRAFTER_CLASS
    from vllm_dflash.serving.seams.patch import MARKER

    out = []
    entry = resolve("model_registry").models.get(DRAFTER_ARCH)
    if getattr(entry, "module_name", None) != DRAFTER_CLASS.split(":")[0]:
        out.append(f"runner {runner}: {DRAFTER_ARCH} is registered to {entry}")
    if runner == "v1":
        proposer = resolve("v1.proposer_name")
        if proposer.__module__ != "vllm_dflash.serving.proposer":
            out.append(f"runner V1 builds {proposer.__module__}.{proposer.__name__}")
    elif version not in SEAMS["v2.speculator_config"].versions:
        if not hasattr(resolve("v2.init_speculator"), MARKER):
            out.append("runner V2: init_speculator is not ours")
    else:
        out += _check_declared_speculator()
    for member in ("execute_model", "sample_tokens"):
        if not hasattr(getattr(resolve(f"{runner}.runner"), member), MARKER):
            out.append(f"runner {runner}: {member} is not timed")
    return out


def _check_declared_speculator() -> list[str]:
    """vLLM 0.34 resolves the speculator from the draft model class's declaration, read
    through its registry: do that with vLLM's own functions for method dflash."""
    from vllm.model_executor.models.registry import _ModelInfo

    from vllm_dflash.serving.drafter_model import DFlashDraftModel

    declared = _ModelInfo.from_model_cls(DFlashDraftModel).speculator_config_class
    spec = SimpleNamespace(
        method="dflash",
        custom_method=None,
        draft_model_config=SimpleNamespace(speculator_config_class=declared),
    )
    config_cls = resolve("v2.declared_speculator")(spec)
    speculator = resolve_class(*config_cls.speculator_class.rsplit(".", 1))
    base = resolve_class("vllm.v1.worker.gpu.spec_decode.speculator", "BaseSpeculator")
    if speculator.__module__ != "vllm_dflash.serving.v2.speculator":
        return [f"vLLM 0.34 would build {config_cls.speculator_class} for method dflash"]
    if not issubclass(speculator, base) or config_cls.base_method != "dflash":
        return [f"{config_cls} is not a dflash speculator config vLLM accepts"]
    return []


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--expect", help="the vLLM version these sources must be")
    args = ap.parse_args(argv)
    from vllm_dflash.serving.seams.environment import installed

    version = installed().version or "?"
    problems = (
        []
        if not args.expect or args.expect == version
        else [f"found vLLM {version}, expected {args.expect}"]
    )
    problems += check(version)
    print("CONTRACT " + json.dumps({"version": version, "problems": problems}), flush=True)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
