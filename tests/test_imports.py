"""Imports run one way (docs/architecture.md, "Imports").

Every import of a product module counts, inside functions too: the modules form no cycle, and a
module imports only its own layer and the layers below it. The generated per-graph module imports
no commfuse module but commfuse.runtime.
"""
from __future__ import annotations

import ast
import pathlib

import networkx as nx
import torch

from tests.common import compile_and_run

ROOT = pathlib.Path(__file__).resolve().parents[1]
# folder -> the package it installs as (pyproject's package-dir)
PACKAGES = {"commfuse": "commfuse", "lowering": "commfuse.lowering", "codegen": "commfuse.codegen"}

# Highest first. A module may import its own layer or a lower one. An entry ending in ".*" is a
# whole package; every product module must be in exactly one layer.
LAYERS = [
    ("entry", ["commfuse", "commfuse.backend", "commfuse.compiled", "commfuse.graph", "commfuse.graph_cache", "commfuse.passes", "commfuse.passes.*",
               "commfuse.decompositions", "commfuse.diff", "commfuse.dump", "commfuse.tune"]),
    ("lowering", ["commfuse.lowering", "commfuse.lowering.*"]),
    ("codegen", ["commfuse.codegen", "commfuse.codegen.wrapper", "commfuse.codegen.triton", "commfuse.codegen.matmul"]),
    ("scheduling", ["commfuse.scheduler", "commfuse.loop_order", "commfuse.remat", "commfuse.mix_order", "commfuse.mm_group", "commfuse.memory", "commfuse.overlap",
                    "commfuse.choices", "commfuse.collectives", "commfuse.tuned_tables"]),
    ("kernel source", ["commfuse.codegen.comm", "commfuse.codegen.common", "commfuse.codegen.triton_ops",
                       "commfuse.codegen.block_ptr", "commfuse.codegen.decode_attention"]),
    ("ir", ["commfuse.ir", "commfuse.dependencies", "commfuse.sizevars"]),
    ("runtime", ["commfuse.runtime", "commfuse.runtime.*"]),
    ("base", ["commfuse.config", "commfuse.compat", "commfuse.virtualized"]),
]


def product_modules() -> dict[str, pathlib.Path]:
    out = {}
    for folder, package in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = [package] + list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def imports_of(name: str, path: pathlib.Path, modules: dict) -> list[tuple[str, int]]:
    """(imported product module, line) for every import statement in the file, at any depth."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in modules:  # `import commfuse.runtime.symm` -> that module
                t = t.rpartition(".")[0]
            if t:
                out.append((t, node.lineno))
    return out


def import_graph() -> nx.DiGraph:
    modules = product_modules()
    graph = nx.DiGraph()
    graph.add_nodes_from(modules)
    for name, path in modules.items():
        for target, line in imports_of(name, path, modules):
            if target != name:
                graph.add_edge(name, target, where=f"{path.relative_to(ROOT)}:{line}")
    return graph


def layer_of(module: str) -> int:
    found = [i for i, (_, members) in enumerate(LAYERS) for m in members
             if module == m or (m.endswith(".*") and module.startswith(m[:-1]))]
    assert len(found) == 1, f"{module} is in layers {[LAYERS[i][0] for i in found]}: place it in one"
    return found[0]


def test_no_top_level_lowering_or_codegen():
    """The two folders are packages inside commfuse once installed: never imported as `lowering`."""
    bad = []
    for path in (ROOT / d for d in PACKAGES):
        for f in path.rglob("*.py"):
            for node in ast.walk(ast.parse(f.read_text())):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                    [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
                bad += [f"{f.relative_to(ROOT)}:{node.lineno} {n}" for n in names
                        if n.split(".")[0] in ("lowering", "codegen")]
    assert not bad, bad


def test_no_import_cycles():
    graph = import_graph()
    assert len(graph) > 40  # the walk found the product modules
    cycles = list(nx.simple_cycles(graph))
    assert not cycles, "\n".join(
        " -> ".join(f"{a} ({graph.edges[a, b]['where']})" for a, b in zip(c, c[1:] + c[:1])) for c in cycles)


def test_imports_run_one_way():
    graph = import_graph()
    layers = {m: layer_of(m) for m in graph}
    upward = [f"{d['where']}: {a} ({LAYERS[layers[a]][0]}) imports {b} ({LAYERS[layers[b]][0]})"
              for a, b, d in graph.edges(data=True) if layers[b] < layers[a]]
    assert not upward, "\n".join(sorted(upward))


def test_generated_module_imports_only_runtime(tmp_path):
    def fn(x, y):
        return (x @ y).relu().sum(1) + x.exp().mean()
    x, y = torch.randn(8, 16), torch.randn(16, 4)
    out, dumps = compile_and_run(fn, x, y, tmp_path=tmp_path)
    torch.testing.assert_close(out, fn(x, y))
    _, code = dumps.only()
    imported = []
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            imported += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            imported.append(node.module)
    ours = [m for m in imported if m.split(".")[0] in ("commfuse", "lowering", "codegen")]
    assert ours, imported  # the wrapper's helpers come from commfuse.runtime
    assert all(m == "commfuse.runtime" or m.startswith("commfuse.runtime.") for m in ours), ours
