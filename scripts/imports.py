"""The project's import graph, read from the code (nothing is imported): its wings in order, every import
that runs against the order, import cycles, and the imports made inside functions.

    python scripts/imports.py            # the summary, then one line per module
    python scripts/imports.py --check    # exit 1 (and say why) on a cycle, an upward import, a
                                         # function-local project import that is not allowed, or a
                                         # name taken from a module that only passes it on

The wings, bottom up: a module may import the wings below its own and modules of its own wing, never
a wing beside or above it. The readers take only the torch-free schemas of the sweep and quality wings.
A project import inside a function is allowed only where a torch-free module needs a wing that loads
torch (the command line's commands, a stored configuration resolving its options). One address per name:
only a package's `__init__` face and variants/_base.py pass names on (`__all__`); everyone else, the
tests and scripts included, imports a name from the module that defines it, and no private name crosses
from one package to another.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("variants", "harness")

# (wing, rank): a module imports only lower ranks, or its own wing
WINGS = (
    ("variants", 0),
    ("harness", 1),
    ("harness.options", 1),
    ("harness.fmt", 1),  # harness: the package's own (empty) module
    ("harness.stats", 1),
    ("harness.core", 2),
    ("harness.store", 3),
    ("harness.policy", 4),
    ("harness.sweep", 5),
    ("harness.quality", 5),
    ("harness.lm", 5),
    ("harness.readers", 6),
    ("harness.viz", 7),
    ("harness.cli", 8),
)
# what the readers may take from the wings that measure: schemas, which import neither torch nor the variants
READER_SCHEMAS = ("harness.sweep.config", "harness.quality.config")
READER_FORBIDDEN = ("variants", "harness.policy", "harness.sweep", "harness.quality", "harness.lm")


def modules(root: Path = ROOT) -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = path
    return out


def _target(name: str, known: dict) -> str | None:
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def imports(name: str, path: Path, known: dict) -> list[tuple[str, int, bool]]:
    """(imported project module, line, inside a function) for every import of `name`'s file."""
    found = []

    def visit(node, local: bool):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                targets = [a.name for a in child.names]
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                    package = package[: len(package) - child.level + 1]
                    base = ".".join(package + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in child.names]
            else:
                targets = []
            for target in targets:
                target = _target(target, known)
                if target and target != name:
                    found.append((target, child.lineno, local))
            visit(child, local or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(ast.parse(path.read_text()), False)
    return found


FACES = ("variants._base",)  # besides the packages' __init__ files: the modules whose job is to pass names on
CALLERS = ("variants", "harness", "scripts", "benchmarks", "tests")  # whose imports the one-address check reads


def _names(path: Path) -> tuple[set[str], dict[str, str], list[str]]:
    """(names the file defines at the top, {name: module} of what it imports by name, its __all__)."""
    defined, imported, exported = set(), {}, []
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                defined.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
            if any(isinstance(t, ast.Name) and t.id == "__all__" for t in getattr(node, "targets", [])):
                exported = [e.value for e in node.value.elts]
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.update({a.asname or a.name: node.module for a in node.names})
    return defined, imported, exported


def forwarding(root: Path, known: dict) -> list[str]:
    """Every name passed on by a module that is not a face, and every import of a name from a module that only
    imported it (or of a private name from another package)."""
    facts = {name: _names(path) for name, path in known.items()}
    found = []
    for name, (defined, imported, exported) in facts.items():
        if known[name].name != "__init__.py" and name not in FACES:
            found += [
                f"{known[name].relative_to(root)}: __all__ passes on {n}, defined in {imported[n]}"
                for n in exported
                if n in imported and n not in defined
            ]
    for package in CALLERS:
        for path in sorted((root / package).rglob("*.py")):
            tree = ast.parse(path.read_text())
            aliases = {}  # a module imported whole, by the name the file calls it
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    aliases.update({a.asname: a.name for a in node.names if a.asname and a.name in facts})
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    aliases.update(
                        {a.asname or a.name: f"{node.module}.{a.name}" for a in node.names}
                        if any(f"{node.module}.{a.name}" in facts for a in node.names)
                        else {}
                    )
            for node in ast.walk(tree):
                if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                    module = aliases.get(node.value.id)
                    if module in facts and known[module].name != "__init__.py" and module not in FACES:
                        defined, imported, _ = facts[module]
                        if node.attr in imported and node.attr not in defined and f"{module}.{node.attr}" not in known:
                            found.append(
                                f"{path.relative_to(root)}:{node.lineno}: reaches {node.attr} through {module}, "
                                f"which imports it from {imported[node.attr]}"
                            )
                if not (isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in facts):
                    continue
                defined, imported, _ = facts[node.module]
                face = known[node.module].name == "__init__.py" or node.module in FACES
                where = f"{path.relative_to(root)}:{node.lineno}"
                for alias in node.names:
                    n = alias.name
                    if not face and n in imported and n not in defined and f"{node.module}.{n}" not in known:
                        found.append(f"{where}: imports {n} from {node.module}, which imports it from {imported[n]}")
                    own = ".".join(path.relative_to(root).parts[:-1])
                    if n.startswith("_") and not n.startswith("__") and package != "tests":
                        if node.module.rpartition(".")[0] != own and node.module != own:
                            found.append(f"{where}: imports the private {n} from {node.module}, another package")
    return found


def wing(name: str) -> tuple[str, int]:
    best = max((w for w in WINGS if name == w[0] or name.startswith(w[0] + ".")), key=lambda w: len(w[0]), default=None)
    if best is None:
        raise SystemExit(
            f"{name}: in no wing of scripts/imports.py's WINGS; add its wing there (and to the README's Layout)"
        )
    return best


def loads_torch(known: dict, graph: dict) -> set[str]:
    """The modules whose top-level imports (followed through the project) load torch."""
    direct = {
        name
        for name, path in known.items()
        if any(
            isinstance(n, (ast.Import, ast.ImportFrom))
            and any(
                (a.name if isinstance(n, ast.Import) else (n.module or "")).split(".")[0] == "torch" for a in n.names
            )
            for n in ast.parse(path.read_text()).body
        )
    }
    heavy, changed = set(direct), True
    while changed:
        changed = False
        for name, edges in graph.items():
            if name not in heavy and any(t in heavy and not local for t, _, local in edges):
                heavy.add(name)
                changed = True
    return heavy


def cycles(graph: dict) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), every import counted."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]
    sys.setrecursionlimit(10000)

    def connect(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in {t for t, _, _ in graph[v]}:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            connect(v)
    return found


def floors(graph: dict) -> dict[str, int]:
    """Each package's height: a module stands one floor above the highest module of its own package it imports."""
    height: dict[str, int] = {}

    def floor(name: str) -> int:
        inside = [t for t, _, _ in graph[name] if t != name and t.rpartition(".")[0] == name.rpartition(".")[0]]
        return height.setdefault(name, 1 + max(map(floor, inside), default=0))

    return {p: max(floor(n) for n in graph if n.rpartition(".")[0] == p) for p in {n.rpartition(".")[0] for n in graph}}


def problems(root: Path = ROOT) -> tuple[dict, list[str], dict]:
    known = modules(root)
    graph = {name: imports(name, path, known) for name, path in known.items()}
    heavy = loads_torch(known, graph)
    found = [f"import cycle: {' -> '.join(c)}" for c in cycles(graph)]
    for name, edges in graph.items():
        own, rank = wing(name)
        for target, line, local in edges:
            where = f"{known[name].relative_to(root)}:{line}"
            their, their_rank = wing(target)
            if their != own and their_rank >= rank:
                found.append(
                    f"{where}: {name} imports {target}, a wing {'beside' if their_rank == rank else 'above'} its own"
                )
            if own == "harness.readers" and target.startswith(READER_FORBIDDEN) and target not in READER_SCHEMAS:
                found.append(
                    f"{where}: the reader {name} imports {target} (readers take only {', '.join(READER_SCHEMAS)})"
                )
            if local and not (name not in heavy and target in heavy):
                found.append(
                    f"{where}: {name} imports {target} inside a function; import it at the top"
                    + ("" if name not in heavy else f" ({name} loads torch anyway)")
                )
    found += forwarding(root, known)
    return graph, found, {"heavy": heavy, "known": known}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--check",
        action="store_true",
        help="exit 1 on a cycle, an upward import, a function-local import not allowed or a forwarded name",
    )
    args = parser.parse_args()
    graph, found, facts = problems()
    top = sum(1 for edges in graph.values() for _, _, local in edges if not local)
    local = [(name, target) for name, edges in graph.items() for target, _, is_local in edges if is_local]
    print(
        f"{len(graph)} modules, {top} imports at the top of files, {len(local)} inside functions "
        f"(a torch-free module reaching a wing that loads torch), {len(cycles(graph))} cycles, "
        f"{sum('wing' in p for p in found)} imports against the wings' order, "
        f"{sum('passes on' in p or 'which imports it from' in p for p in found)} names reached through a module "
        "that only passes them on"
    )
    if not args.check:
        for name in sorted(graph):
            tops = sorted({t for t, _, is_local in graph[name] if not is_local})
            lazy = sorted({t for t, _, is_local in graph[name] if is_local})
            torch = " [torch]" if name in facts["heavy"] else ""
            print(
                f"  {name}{torch} -> {', '.join(tops) or '-'}"
                + (f"; inside functions: {', '.join(lazy)}" if lazy else "")
            )
    for line in found:
        print(line)
    return 1 if (args.check and found) else 0


if __name__ == "__main__":
    sys.exit(main())
