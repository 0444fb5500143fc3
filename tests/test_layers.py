"""The package's floors (docs/architecture.md): each module imports only from floors below its own, with no
circles, no private name taken across packages, and an import inside a function only with its reason.

Read from the source (nothing is imported), as ../shared/tools/import_graph.py reads it; imports inside
functions count as dependencies too.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "fivefold"

# Lowest first. A module takes the floor of the longest prefix listed here.
FLOORS = {
    "fivefold.errors": 1,
    "fivefold.config": 2, "fivefold.config_checks": 2, "fivefold.presets": 2,
    "fivefold.config_load": 3,  # loading checks the layout (rules) as it reads
    # pure layout arithmetic: what the planner and the runtime share
    "fivefold.memory.formulas": 3, "fivefold.memory.communication": 3, "fivefold.memory.activations": 3,
    "fivefold.memory.replay": 3, "fivefold.memory.replay_layers": 3, "fivefold.memory.replay_moe": 3,
    "fivefold.memory.replay_compiled": 3, "fivefold.memory.backward_temporaries": 3,
    "fivefold.memory.categories": 3, "fivefold.memory.host": 3, "fivefold.parallel.rules": 3, "fivefold.parallel.pipeline_schedules": 3,
    "fivefold.parallel.placement": 3, "fivefold.planner.hardware": 3,
    "fivefold.model": 4, "fivefold.kernels": 4,
    # formats
    "fivefold.data": 5, "fivefold.checkpoint": 5, "fivefold.interop": 5, "fivefold.quant": 5,
    # mechanisms
    "fivefold.parallel": 6, "fivefold.train": 6, "fivefold.finetune": 6,
    # assembly
    "fivefold.weights": 7, "fivefold.train.parallelize": 7,
    # runtimes
    "fivefold.train.trainer": 8, "fivefold.train.metrics": 8, "fivefold.serve": 8, "fivefold.memory": 8,
    "fivefold.planner": 8,
    "fivefold.commands": 9, "fivefold.cli": 9, "fivefold.__main__": 9, "fivefold": 9,
}
MAX_BACK_UP = 3  # files importing a file on a higher floor


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def floor(module: str) -> int:
    name = module
    while name not in FLOORS:
        name = name.rpartition(".")[0]
    return FLOORS[name]


def read_imports():
    """(importer, imported module, name or None, line, in a function, reason comment present)."""
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}

    def owner(name: str) -> str | None:
        while name:
            if name in files:
                return name
            name = name.rpartition(".")[0]
        return None

    found = []
    for mod, path in files.items():
        lines = path.read_text().splitlines()
        tree = ast.parse("\n".join(lines), str(path))
        is_pkg = path.name == "__init__.py"
        in_func = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                   for n in ast.walk(f)}
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, ast.Import):
                targets = [(a.name, None) for a in node.names if a.name.split(".")[0] == "fivefold"]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base_parts = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    base_parts = base_parts[:len(base_parts) - (node.level - 1)]
                    base = ".".join(base_parts + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                if base.split(".")[0] != "fivefold":
                    continue
                targets = [(f"{base}.{a.name}" if f"{base}.{a.name}" in files else base, a.name) for a in node.names]
            for target, name in targets:
                dst = owner(target)
                if dst is None or dst == mod:
                    continue
                # the reason: a comment on the import, above it, or on the first import of its block
                first = node.lineno - 1
                while first > 0 and lines[first - 1].strip().startswith(("from ", "import ")):
                    first -= 1
                above = lines[first - 1].strip() if first > 0 else ""
                reason = "#" in lines[node.lineno - 1] or "#" in lines[first] or above.startswith("#")
                found.append((mod, dst, name, f"{path.relative_to(PACKAGE.parent)}:{node.lineno}",
                              id(node) in in_func, reason))
    return files, found


def circles(files, found) -> list[list[str]]:
    edges = defaultdict(set)
    for src, dst, *_ in found:
        edges[src].add(dst)
    index, low, stack, on, sccs = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while (w := stack.pop()) != v:
                on.discard(w)
                comp.append(w)
            on.discard(v)
            if comp:
                sccs.append(sorted(comp + [v]))

    for v in files:
        if v not in index:
            visit(v)
    return sccs


def test_no_import_circles():
    files, found = read_imports()
    assert circles(files, found) == []


def test_imports_run_down_the_floors():
    _, found = read_imports()
    back_up = sorted({f"{src} (floor {floor(src)}) -> {dst} (floor {floor(dst)})"
                      for src, dst, *_ in found if floor(dst) > floor(src)})
    assert len(back_up) <= MAX_BACK_UP, "\n".join(back_up)


def test_no_private_name_imported_across_packages():
    _, found = read_imports()
    private = [f"{where}: {name} from {dst}" for src, dst, name, where, _, _ in found
               if name and name.startswith("_") and not name.startswith("__")
               and dst.split(".")[:2] != src.split(".")[:2]]
    assert private == []


def test_imports_inside_functions_say_why():
    """An optional dependency or start-up time: a comment on the import, above it, or on the first import of
    its block says which."""
    _, found = read_imports()
    silent = sorted({where for *_, where, in_func, reason in found if in_func and not reason})
    assert silent == [], f"{len(silent)} imports inside functions without a reason:\n" + "\n".join(silent)
