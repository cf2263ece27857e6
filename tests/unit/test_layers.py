"""The package's import structure: no cycles between modules (function-level and TYPE_CHECKING imports count),
and layers that only point down. Pure AST: nothing is imported."""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "gateway"

# Top to bottom; a package may import its own modules and any package below it, never one above.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("__main__",),
    ("cli",),
    ("bench", "report"),
    ("sim", "testing"),  # the stand-ins for vLLM: for the CLI and the benchmarks, never for the server
    ("admin",),
    ("epp",),  # the Endpoint Picker: the proxy's decision answered to Envoy instead of forwarded
    ("proxy",),
    ("runtime",),
    ("cluster",),
    ("overrides",),
    ("routing",),
    ("fleet",),
    ("config",),
    ("store",),
    ("observability",),
    ("errors", "periodic", "__init__"),  # root modules, importable from anywhere
)
# Importable from any layer: constants only, and they import nothing of the gateway themselves.
CONTRACTS = frozenset({"gateway.admin.protocol"})
# Standalone packages: they import nothing of the gateway's layers (the simulator is a stand-in for vLLM).
STANDALONE = {"sim": frozenset({"sim"}), "testing": frozenset({"testing", "sim"})}


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the gateway modules it imports anywhere in its body (relative imports resolved)."""
    files = {module_name(p, root): p for p in root.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for mod, path in files.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*anchor, base] if base else anchor)
                names = [base, *(f"{base}.{a.name}" for a in node.names)]
            edges.update(n for n in names if n in files and n != mod)
        graph[mod] = edges
    return graph


def cycles(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def unit(mod: str) -> str:
    """The layer unit of a module: its subpackage, or the root module's own name."""
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def layer_violations(graph: Mapping[str, Iterable[str]]) -> list[str]:
    rank = {name: i for i, names in enumerate(LAYERS) for name in names}
    out = []
    for mod, targets in graph.items():
        src = unit(mod)
        for target in targets:
            dst = unit(target)
            if dst == src or target in CONTRACTS:
                if mod in CONTRACTS and target != mod:
                    out.append(f"{mod} -> {target}: a contract module imports nothing of the gateway")
                continue
            if src in STANDALONE:
                if dst not in STANDALONE[src] and dst not in ("__init__",):
                    out.append(f"{mod} -> {target}: {src}/ imports nothing of the gateway")
                continue
            if src not in rank or dst not in rank:
                out.append(f"{mod} -> {target}: {src if src not in rank else dst} has no layer")
            elif rank[dst] < rank[src]:
                out.append(f"{mod} -> {target}: {src} may not import {dst} (a layer above it)")
    return sorted(out)


def test_no_import_cycles() -> None:
    assert cycles(import_graph(ROOT)) == []


def test_layers_only_point_down() -> None:
    assert layer_violations(import_graph(ROOT)) == []


def test_routing_does_no_io() -> None:
    banned = ("asyncio", "socket", "aiohttp", "httpx", "redis", "subprocess", "urllib", "starlette", "uvicorn")
    for path in (ROOT / "routing").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [node.module]
            for name in names:
                assert name.split(".")[0] not in banned, f"{path.name} imports {name}"


def _tree(tmp_path: Path, files: Mapping[str, str]) -> Path:
    root = tmp_path / "gateway"
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return root


def test_a_planted_cycle_is_found(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "__init__.py": "",
            "routing/__init__.py": "",
            "routing/a.py": "from gateway.routing.b import x\n",
            "routing/b.py": "def f():\n    from gateway.routing import a\n",
        },
    )
    assert cycles(import_graph(root)) == [["gateway.routing.a", "gateway.routing.b"]]


def test_a_hidden_upward_import_is_found(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "__init__.py": "",
            "routing/__init__.py": "",
            "routing/plan.py": (
                "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from gateway.runtime.live import L\n"
            ),
            "runtime/__init__.py": "",
            "runtime/live.py": "from gateway.routing.plan import P\n",
        },
    )
    assert cycles(import_graph(root)) == [["gateway.routing.plan", "gateway.runtime.live"]]
    assert layer_violations(import_graph(root)) == [
        "gateway.routing.plan -> gateway.runtime.live: routing may not import runtime (a layer above it)"
    ]


@pytest.mark.parametrize("src", ["sim/engine.py", "testing/fake.py"])
def test_standalone_packages_import_nothing_of_the_gateway(tmp_path: Path, src: str) -> None:
    root = _tree(
        tmp_path,
        {
            "__init__.py": "",
            "sim/__init__.py": "",
            "testing/__init__.py": "",
            "config/__init__.py": "",
            "config/schema.py": "",
            src: "from gateway.config.schema import X\n",
        },
    )
    assert len(layer_violations(import_graph(root))) == 1
