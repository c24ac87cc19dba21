#!/usr/bin/env python3
"""Import cycles in nalu_cuda, counting the imports inside functions.

Builds the module graph of the nalu_cuda package with Python's ast (every `import` and
`from ... import` statement anywhere in a module: top level, inside functions, under
`if TYPE_CHECKING:`), prints its strongly connected components of more than one module (or a
module importing itself) and exits 1 if there is one that KNOWN_CYCLES does not list.

  python .ci/import_cycles.py [--all]   # --all: also print the graph's edges
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "nalu_cuda"

# Cycles that are known and owned elsewhere, as frozensets of module names. Empty: none is allowed.
KNOWN_CYCLES: list[frozenset[str]] = []


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).parts)
    parts[-1] = parts[-1].split(".")[0]  # x.py, x.cpython-311-x86_64-linux-gnu.so, x.pyd
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def collect_modules() -> dict[str, Path]:
    """Every Python module of the package, and its compiled extensions (leaves: no imports)."""
    files = sorted((ROOT / PACKAGE).rglob("*.py"))
    files += sorted(p for ext in ("*.so", "*.pyd") for p in (ROOT / PACKAGE).rglob(ext))
    return {module_name(p): p for p in files}


def resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The longest prefix of the dotted `name` that is a module of the package."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def imports_of(mod: str, path: Path, modules: dict[str, Path]) -> set[str]:
    if path.suffix != ".py":
        return set()
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    is_pkg = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = resolve(alias.name, modules)
                if target:
                    out.add(target)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = mod.split(".") if is_pkg else mod.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if not source.startswith(PACKAGE):
                continue
            for alias in node.names:
                # `from pkg import submodule` imports the submodule; otherwise the module itself.
                target = resolve(f"{source}.{alias.name}", modules) or resolve(source, modules)
                if target:
                    out.add(target)
    # Importing a submodule runs its packages' __init__ too, but a package importing its own
    # submodules is not a cycle by itself: keep the edges as written.
    out.discard(mod)
    return out


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    result: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            advanced = False
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                    advanced = True
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    component.append(top)
                    if top == node:
                        break
                result.append(sorted(component))
    return result


def main(argv: list[str]) -> int:
    modules = collect_modules()
    graph = {m: imports_of(m, p, modules) for m, p in modules.items()}
    if "--all" in argv:
        for m in sorted(graph):
            for t in sorted(graph[m]):
                print(f"{m} -> {t}")
    cycles = [c for c in strongly_connected(graph) if len(c) > 1]
    unknown = [c for c in cycles if frozenset(c) not in KNOWN_CYCLES]
    print(f"{len(modules)} modules, {sum(map(len, graph.values()))} imports, {len(cycles)} cycle(s)")
    for c in sorted(cycles, key=len, reverse=True):
        tag = "known" if frozenset(c) in KNOWN_CYCLES else "CYCLE"
        print(f"  {tag} ({len(c)}): " + ", ".join(c))
        members = set(c)
        for m in c:
            inside = sorted(graph[m] & members)
            print(f"      {m} -> {', '.join(inside)}")
    return 1 if unknown else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
