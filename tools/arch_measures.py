"""Architecture measures of src/dflash_etl: import circles, arrows running back up the floors,
circles between sibling packages, long functions, big modules.

Why: the issues ask for these before/after, and tests/test_architecture.py keeps them from
growing back. Function-local imports count as imports (they are how circles hide).

    python tools/arch_measures.py [--json]
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "dflash_etl"
# The floors, bottom up (docs/architecture.md): a module imports its own floor and the ones
# below it, never one above (an arrow running back up).
FLOORS = {
    "core": 0,
    "io": 1, "formats": 1,
    "templates": 2, "mix": 2,
    "models": 3,
    "executors": 4, "validation": 4,
    "report": 5,
    "runner": 6,
    "stages": 7,
    "handoff": 8, "evaluate": 8, "lineage": 8,
    "cli": 9, "__main__": 9,
}


def floor_of(module: str) -> int:
    """A module's floor, by its top-level package or module (the package root is core's)."""
    parts = module.split(".")
    return FLOORS[parts[1]] if len(parts) > 1 else 0


def module_name(path: Path, src: Path = SRC) -> str:
    parts = list(path.relative_to(src).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def modules(src: Path = SRC) -> dict[str, Path]:
    return {module_name(p, src): p for p in sorted((src / PACKAGE).rglob("*.py"))}


def _resolve(mod: str, is_pkg: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def imports(known: dict[str, Path]) -> dict[str, set[str]]:
    """Every module's imports of other package modules (top-level and function-local)."""
    graph: dict[str, set[str]] = {}
    for mod, path in known.items():
        tree = ast.parse(path.read_text(), str(path))
        is_pkg = path.name == "__init__.py"
        out: set[str] = set()
        for node in ast.walk(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(mod, is_pkg, node)
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                           for a in node.names]
            for t in targets:
                while t and t not in known:
                    t = t.rpartition(".")[0]
                if t and t != mod and t.startswith(PACKAGE):
                    out.add(t)
        graph[mod] = out
    # `from pkg import name` is an import of pkg.name when that is a module, else of pkg; the
    # package __init__ that importing a submodule also runs is not counted.
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []
    counter = 0

    def visit(v: str) -> None:
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def upward_from_core(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    core = f"{PACKAGE}.core"
    return sorted(
        (a, b)
        for a, deps in graph.items()
        if a == core or a.startswith(core + ".")
        for b in deps
        if not (b == core or b.startswith(core + ".")) and b != PACKAGE
    )


def arrows_up(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Imports from a floor to one above it."""
    return sorted((a, b) for a, deps in graph.items() for b in deps
                  if floor_of(b) > floor_of(a))


def package_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Circles between the packages and modules directly below a top-level package
    (models.fleet <-> models.generation): no module circle, but neither can be read alone."""
    def unit(module: str) -> str:
        return ".".join(module.split(".")[:3])

    collapsed: dict[str, set[str]] = {}
    for a, deps in graph.items():
        collapsed.setdefault(unit(a), set()).update(unit(b) for b in deps if unit(b) != unit(a))
    return cycles(collapsed)


def long_functions(known: dict[str, Path], over: int = 50) -> list[tuple[int, str]]:
    rows = []
    for mod, path in known.items():
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                n = node.end_lineno - node.lineno + 1
                if n > over:
                    rows.append((n, f"{mod}.{node.name}"))
    return sorted(rows, reverse=True)


def measures(src: Path = SRC) -> dict:
    known = modules(src)
    graph = imports(known)
    longs = long_functions(known)
    sizes = sorted(((len(p.read_text().splitlines()), m) for m, p in known.items()),
                   reverse=True)
    return {
        "import_cycles": cycles(graph),
        "core_upward_imports": upward_from_core(graph),
        "arrows_up": arrows_up(graph),
        "package_cycles": package_cycles(graph),
        "functions_over_50_lines": len(longs),
        "longest_functions": longs[:15],
        "modules_over_600_lines": [(n, m) for n, m in sizes if n > 600],
        "module_lines": sizes[:10],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    m = measures()
    if args.json:
        print(json.dumps(m, indent=1))
        return
    print(f"import cycles: {len(m['import_cycles'])}")
    for c in m["import_cycles"]:
        print("  " + " <-> ".join(c))
    print(f"imports from core/ to a higher layer: {len(m['core_upward_imports'])}")
    for a, b in m["core_upward_imports"]:
        print(f"  {a} -> {b}")
    print(f"arrows running back up a floor: {len(m['arrows_up'])}")
    for a, b in m["arrows_up"]:
        print(f"  {a} -> {b}")
    print(f"circles between sibling packages: {len(m['package_cycles'])}")
    for c in m["package_cycles"]:
        print("  " + " <-> ".join(c))
    print(f"modules over 600 lines: {len(m['modules_over_600_lines'])}")
    print(f"functions over 50 lines: {m['functions_over_50_lines']}")
    for n, f in m["longest_functions"]:
        print(f"  {n:4d} {f}")
    print("largest modules:")
    for n, f in m["module_lines"]:
        print(f"  {n:5d} {f}")


if __name__ == "__main__":
    main()
