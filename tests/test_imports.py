"""Serving imports nothing from the harness, and the package's folders import each other without a cycle.

The harness (bench/, gates/, tiny/) sits beside the product: it may import the product, the product never imports
it. Two checks: a fresh interpreter that imports the serving entry points (and resolves the default model as
`deltaserve serve` with no MODEL does) finds no harness module loaded, nor aiohttp or matplotlib (the `bench`
extra, which `pip install -e .` leaves out); and the folder-level graph built from every import statement of every
.py file under deltaserve/ (function-local and TYPE_CHECKING ones included, relative ones resolved) has no cycle
and no edge from a product folder into the harness.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "deltaserve"
HARNESS = ("bench", "gates", "tiny")
# The `bench` extra's libraries: `pip install -e .` does not install them, so serving must not import them.
BENCH_EXTRA = ("aiohttp", "matplotlib")
# The node of deltaserve/__init__.py (the package's own namespace: LLM, SamplingParams, ...).
PACKAGE_NODE = "deltaserve"

# Run in a fresh interpreter: import what serving imports, resolve the default model, print every loaded module.
SERVING_PROBE = """
import argparse, contextlib, io, json, sys

import deltaserve.api.server, deltaserve.api.cli, deltaserve.engine, deltaserve.engine.llm, deltaserve.engine.cli
import deltaserve.runner, deltaserve.runner.executor, deltaserve.runner.model_runner
from deltaserve import LLM
from deltaserve.cli import main

parser = argparse.ArgumentParser()
deltaserve.api.cli.add_arguments(parser)
deltaserve.api.cli.resolve_model(parser.parse_args([]))
for command in ("serve", "generate"):
    with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):
        main([command, "--help"])
print(json.dumps(sorted(sys.modules)))
"""


def test_serving_loads_no_harness_module() -> None:
    result = subprocess.run(
        [sys.executable, "-c", SERVING_PROBE], cwd=ROOT, capture_output=True, text=True, timeout=300, check=False
    )
    assert result.returncode == 0, result.stderr
    loaded = json.loads(result.stdout.strip().splitlines()[-1])
    assert "deltaserve.api.server" in loaded and "deltaserve.default_model" in loaded
    forbidden = [
        name
        for name in loaded
        if name.split(".")[:2] in [["deltaserve", folder] for folder in HARNESS] or name.split(".")[0] in BENCH_EXTRA
    ]
    assert not forbidden, f"serving imported harness modules or the bench extra's libraries: {forbidden}"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _node(module: str) -> str | None:
    """The folder (or top-level module) of deltaserve that `module` belongs to; None outside deltaserve."""
    parts = module.split(".")
    if parts[0] != "deltaserve":
        return None
    return parts[1] if len(parts) > 1 else PACKAGE_NODE


def _imported_modules(tree: ast.AST, module: str, is_package: bool) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import statement in the tree, nested ones included."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if source == "deltaserve":
                # `from deltaserve import env` names the submodule env; `from deltaserve import LLM` the package.
                for alias in node.names:
                    is_submodule = (PACKAGE / alias.name).is_dir() or (PACKAGE / f"{alias.name}.py").is_file()
                    found.append((node.lineno, f"deltaserve.{alias.name}" if is_submodule else "deltaserve"))
            else:
                found.append((node.lineno, source))
    return found


def import_graph() -> dict[tuple[str, str], list[str]]:
    """(importing node, imported node) -> the 'file:line module' sites of every edge between two nodes."""
    edges: dict[tuple[str, str], list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        module = _module_name(path)
        source = _node(module)
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for line, imported in _imported_modules(tree, module, path.name == "__init__.py"):
            target = _node(imported)
            if target is not None and target != source:
                edges.setdefault((source, target), []).append(f"{path.relative_to(ROOT)}:{line} {imported}")
    return edges


def _cycles(edges: dict[tuple[str, str], list[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan), each sorted."""
    graph: dict[str, list[str]] = {}
    for a, b in edges:
        graph.setdefault(a, []).append(b)
        graph.setdefault(b, [])
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return components


def _describe(edges: dict[tuple[str, str], list[str]], pairs: list[tuple[str, str]]) -> str:
    return "\n".join(f"{a} -> {b}: {', '.join(edges[a, b])}" for a, b in pairs)


def test_the_graph_sees_imports_of_every_kind() -> None:
    edges = import_graph()
    # module-level, function-local (api/cli.py imports the engine inside run) and harness -> product edges
    assert ("api", "engine") in edges and ("engine", "scheduler") in edges and ("gates", "tiny") in edges
    assert any(site.startswith("deltaserve/api/cli.py") for site in edges["api", "engine"])
    tree = ast.parse("def f():\n    from ..engine import core\n    from . import sibling\n")
    assert _imported_modules(tree, "deltaserve.api.cli", False) == [
        (2, "deltaserve.engine"),
        (3, "deltaserve.api"),
    ]


def test_no_product_folder_imports_the_harness() -> None:
    edges = import_graph()
    bad = sorted(pair for pair in edges if pair[0] not in HARNESS and pair[1] in HARNESS)
    assert not bad, "product -> harness imports:\n" + _describe(edges, bad)


def test_no_import_cycle_between_folders() -> None:
    edges = import_graph()
    cycles = _cycles(edges)
    inside = sorted(pair for pair in edges for cycle in cycles if pair[0] in cycle and pair[1] in cycle)
    assert not cycles, f"import cycles between folders {cycles}:\n" + _describe(edges, inside)
