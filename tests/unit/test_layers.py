"""Imports only go down: the runtime packages' layers, read from the source with ``ast``.

    gateway                   the HTTP surface; the composition root
    cache, limits, routing,   the services the gateway asks (each ignores the others)
    conversations, batch
    sim                       the simulated replica `fleetgate sim` runs (vLLM's gauge names)
    capacity                  the planner `fleetgate bench` runs (reads replicas' /metrics)
    tokens                    what a model's tokenizer counts: the gateway's stages and the
                              simulator (its token ids must be the gateway's) both read it
    replicas                  the fleet routing chooses from, and what its engines publish
    dialects                  what each API's bodies and streams look like (one per API)
    redisconn                 how the shared stores reach Redis
    common                    shared by all, importing none of them

A package imports only packages of a lower layer (not one beside it: the cache's store does
not borrow the limiter's breaker, both take it from ``common``), and no module takes part in
an import cycle. Every import counts: module-level, inside functions, and under ``if TYPE_CHECKING:``.
A type-only import still makes the lower module know the higher one (the case that started
this test: ``replicas`` naming ``gateway.settings`` in its annotations), and a cycle closed
by one is still a cycle for a reader.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

LAYERS = {
    "gateway": 5,
    "cache": 4,
    "limits": 4,
    "routing": 4,
    "sim": 4,
    "capacity": 4,
    "conversations": 4,
    "batch": 4,
    "tokens": 3,
    "replicas": 2,
    "dialects": 2,
    "redisconn": 1,
    "common": 0,
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def runtime_modules() -> dict[str, Path]:
    return {module_name(p): p for package in LAYERS for p in sorted((ROOT / package).rglob("*.py"))}


def imported(module: str, path: Path, known: set[str]) -> Iterator[tuple[str, int]]:
    """The runtime modules ``module`` imports, with the line of each import."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield from _resolve(alias.name, known, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                # ``from pkg import mod`` imports the module pkg.mod; ``from mod import name`` mod.
                candidate = f"{base}.{alias.name}"
                yield from _resolve(candidate if candidate in known else base, known, node.lineno)


def _resolve(name: str, known: set[str], line: int) -> Iterator[tuple[str, int]]:
    # ``import a.b.c`` depends on a.b.c; ignore anything outside the runtime packages.
    while name and name not in known:
        name = name.rpartition(".")[0]
    if name:
        yield name, line


def graph() -> dict[str, dict[str, int]]:
    modules = runtime_modules()
    known = set(modules)
    edges: dict[str, dict[str, int]] = {}
    for module, path in modules.items():
        edges[module] = {}
        for target, line in imported(module, path, known):
            if target != module:
                edges[module].setdefault(target, line)
    return edges


def upward_imports(edges: dict[str, dict[str, int]]) -> list[str]:
    found = []
    for module, targets in edges.items():
        here = module.split(".")[0]
        for target, line in targets.items():
            there = target.split(".")[0]
            if there != here and LAYERS[there] >= LAYERS[here]:
                found.append(f"{module}:{line} imports {target} (layer {LAYERS[there]} >= {LAYERS[here]})")
    return sorted(found)


def cycles(edges: dict[str, dict[str, int]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in edges.get(node, {}):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return sorted(found)


def test_every_runtime_package_has_a_layer() -> None:
    packages = {p.parent.name for p in ROOT.glob("*/__init__.py")}
    assert packages - {"bench", "tests", "scripts", "deploy", "docs"} <= set(LAYERS)


def test_no_import_goes_up_or_sideways() -> None:
    assert upward_imports(graph()) == []


def test_no_import_cycle() -> None:
    assert cycles(graph()) == []


def test_the_checks_see_what_they_must_refuse() -> None:
    # A type-only upward import and a two-module cycle, as the checks above read them.
    edges = {
        "replicas.fleet": {"gateway.settings": 30},
        "gateway.settings": {"replicas.fleet": 12},
        "cache.redis_store": {"limits.breaker": 36},
        "gateway.app": {"gateway.admin": 32},
        "gateway.admin": {"gateway.app": 19},
    }
    assert upward_imports(edges) == [
        "cache.redis_store:36 imports limits.breaker (layer 4 >= 4)",
        "replicas.fleet:30 imports gateway.settings (layer 5 >= 2)",
    ]
    assert cycles(edges) == [["gateway.admin", "gateway.app"], ["gateway.settings", "replicas.fleet"]]


def test_type_only_and_function_level_imports_are_read(tmp_path: Path) -> None:
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from gateway.settings import Settings\n"
        "def f() -> None:\n"
        "    import cache.keys\n"
        "from . import health\n"
    )
    path = tmp_path / "fleet.py"
    path.write_text(source)
    known = {"gateway.settings", "cache.keys", "replicas.health", "replicas.fleet"}
    assert sorted(imported("replicas.fleet", path, known)) == [
        ("cache.keys", 5),
        ("gateway.settings", 3),
        ("replicas.health", 6),
    ]


def test_bench_never_imports_scripts() -> None:
    # Outside the runtime layers too, imports only go down: the dev scripts (training the
    # classifier and the semantic cache's models) read bench's labelled data and recipes, so
    # what both need lives in bench, and bench never reaches up into a script.
    modules = {module_name(p): p for top in ("bench", "scripts") for p in sorted((ROOT / top).rglob("*.py"))}
    known = set(modules)
    found = [
        f"{module}:{line} imports {target}"
        for module, path in modules.items()
        if module.split(".")[0] == "bench"
        for target, line in imported(module, path, known)
        if target.split(".")[0] == "scripts"
    ]
    assert found == []
