"""The package's import graph: layered, no cycle, and no production module reaching for test
helpers or dev-only dependencies. Read from the sources with ``ast`` (imports inside
functions count too), so nothing is imported."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "vllm_dflash"

# Each unit (a subpackage or a top-level module of vllm_dflash) imports only from units of a
# lower layer. A new unit must be placed here, which is the point: say where it sits.
LAYERS: list[set[str]] = [
    {"errors", "_C", "__version__"},
    {"safe_paths", "versions", "env_settings"},
    {"config", "data", "observability", "ops"},
    {"checkpoint", "adaptive", "assets"},
    {"reference", "serving"},
    {"bench", "gpu_check", "plugin"},
    {"train", "demo"},
    {"cli"},
    {"__main__"},
]
LAYER_OF = {unit: i for i, layer in enumerate(LAYERS) for unit in layer}
# Test helpers (tests/) and what only the dev extra installs.
FORBIDDEN_TOP_LEVEL = {
    "factory",
    "oracles",
    "stats",
    "distill",
    "serving_harness",
    "pytest",
    "scipy",
}


def _unit(module: str) -> str:
    return module.split(".")[1]


def _imports(path: Path) -> list[tuple[str, int]]:
    """(absolute module name, line) for every import statement in ``path``."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "vllm_dflash":  # from vllm_dflash import assets, __version__
                out += [(f"vllm_dflash.{a.name}", node.lineno) for a in node.names]
            else:
                out.append((node.module, node.lineno))
        elif isinstance(node, ast.ImportFrom) and node.level:
            raise AssertionError(f"{path}:{node.lineno}: relative import; write it absolute")
    return out


def _edges() -> list[tuple[str, str, str]]:
    """(importing unit, imported unit, where) for imports between different units."""
    edges = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent)
        src = rel.parts[1].removesuffix(".py")
        for module, line in _imports(path):
            if module.startswith("vllm_dflash.") and _unit(module) != src:
                edges.append((src, _unit(module), f"{rel}:{line}"))
    return edges


def test_every_unit_has_a_layer():
    units = {p.name.removesuffix(".py") for p in PACKAGE.iterdir() if not p.name.startswith(".")}
    units = {u for u in units if u not in {"__pycache__", "__init__"} and not u.endswith(".so")}
    units = {u.split(".")[0] for u in units}
    assert units <= set(LAYER_OF), f"place these in LAYERS: {sorted(units - set(LAYER_OF))}"


def test_imports_only_go_down():
    upward = [
        f"{where}: {src} (layer {LAYER_OF[src]}) imports {dst} (layer {LAYER_OF[dst]})"
        for src, dst, where in _edges()
        if LAYER_OF[dst] >= LAYER_OF[src]
    ]
    assert not upward, "imports that go up or sideways (a cycle waiting to happen):\n" + "\n".join(
        upward
    )


def test_no_production_module_imports_test_helpers_or_dev_dependencies():
    bad = [
        f"{path.relative_to(PACKAGE.parent)}:{line}: {module}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for module, line in _imports(path)
        if module.split(".")[0] in FORBIDDEN_TOP_LEVEL
    ]
    assert not bad, "production code imports test helpers or dev-only packages:\n" + "\n".join(bad)


def test_the_graph_check_sees_an_upward_import(tmp_path):
    """The checker itself: an import from a lower layer to a higher one is reported."""
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from vllm_dflash.train import trainer\n")
    assert _imports(probe) == [("vllm_dflash.train", 2)]
    assert LAYER_OF["train"] > LAYER_OF["bench"]
