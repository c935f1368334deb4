"""The package's import graph, read from the source with ``ast``, has no cycles and
no upward edge.

Every ``import`` counts, the ones inside functions too: a cycle hidden behind an
import in a function body is still two modules that cannot be understood (or
loaded, or tested) one without the other. The cure is to move code where it
belongs (a factory above the classes it picks, a leaf module for what both
sides need), not to defer the import.

An import of ``a.b.c`` from outside the package ``a.b`` also runs ``a/b/__init__.py``
(an edge to ``a.b``), as Python does; from inside ``a.b`` that init is already
running, so it adds nothing. The root package is inside every module's path, so
its facade ``__init__`` is an edge only where a module imports a name from it.

Floors (docs/architecture.md, "Floors", read from there): a module imports only
from its own floor or lower ones.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

# The source tree, not the installed copy: the graph is a property of the code.
PACKAGE_DIR = Path(__file__).resolve().parent.parent / "python" / "enginecore"
PACKAGE = "enginecore"
ARCHITECTURE = PACKAGE_DIR.parent.parent / "docs" / "architecture.md"


def module_names() -> dict[str, Path]:
    """Module name -> source file: ``.py`` files, the Cython ``.pyx`` modules and the
    extension's ``.pyi`` stub (compiled modules import nothing of the package)."""
    names: dict[str, Path] = {}
    for path in sorted(PACKAGE_DIR.rglob("*")):
        if path.suffix not in (".py", ".pyx", ".pyi") or "__pycache__" in path.parts:
            continue
        parts = [PACKAGE, *path.relative_to(PACKAGE_DIR).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names.setdefault(".".join(parts), path)
    return names


def _nearest_module(name: str, modules: dict[str, Path]) -> str | None:
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package modules ``module`` imports anywhere in its source. ``from X import
    y`` is an edge to ``X.y`` when that is a module, else to ``X``."""
    if path.suffix != ".py":  # compiled: Cython, the extension
        return set()
    is_package = path.name == "__init__.py"
    package = module if is_package else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            targets = [f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules
                       else source for alias in node.names]
        else:
            continue
        for target in targets:
            if target == PACKAGE or target.startswith(PACKAGE + "."):
                resolved = _nearest_module(target, modules)
                if resolved is not None and resolved != module:
                    found.add(resolved)
                    found |= _package_inits_run(module, resolved, modules)
    return found


def _package_inits_run(importer: str, target: str, modules: dict[str, Path]) -> set[str]:
    """The packages whose ``__init__`` importing ``target`` runs that ``importer``
    is not already inside (the root package is inside every module's path)."""
    run: set[str] = set()
    parts = target.split(".")
    for depth in range(2, len(parts)):
        package = ".".join(parts[:depth])
        if package in modules and not (importer == package
                                       or importer.startswith(package + ".")):
            run.add(package)
    return run


def import_graph() -> dict[str, set[str]]:
    modules = module_names()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_cycle_finder_finds_cycles():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_graph_sees_imports_inside_functions(tmp_path):
    (tmp_path / "m.py").write_text("def f():\n    from enginecore.config import EngineArgs\n")
    modules = {"enginecore.config": tmp_path / "config.py", "enginecore.m": tmp_path / "m.py"}
    assert imports_of("enginecore.m", tmp_path / "m.py", modules) == {"enginecore.config"}


def test_graph_knows_the_package():
    graph = import_graph()
    assert "enginecore._C" in graph  # by its stub
    assert "enginecore.frontend.step_loop_cy" in graph
    assert "enginecore.sched.scheduler" in graph["enginecore.core.engine_core"]


def test_no_import_cycles():
    graph = import_graph()
    found = cycles(graph)
    described = ["\n".join(f"  {m} -> {sorted(graph[m] & set(c))}" for m in c) for c in found]
    assert not found, "import cycles in the package:\n" + "\n\n".join(described)


def floors() -> dict[str, int]:
    """Module or room name (``sched``, ``config``, ``enginecore`` for the root
    facade) -> floor number, from the ``floors`` block of docs/architecture.md."""
    block = re.search(r"```floors\n(.*?)```", ARCHITECTURE.read_text(), re.DOTALL)
    assert block, "docs/architecture.md has no ```floors block"
    table: dict[str, int] = {}
    for line in block.group(1).splitlines():
        number, _, rest = line.partition(" ")
        for name in rest.partition(":")[2].split():
            table[name] = int(number)
    return table


def floor_of(module: str, table: dict[str, int]) -> int | None:
    if module == PACKAGE:
        return table.get(PACKAGE)
    return table.get(module.split(".")[1])


def upward_imports(graph: dict[str, set[str]], table: dict[str, int]) -> list[str]:
    found = []
    for module in sorted(graph):
        own = floor_of(module, table)
        for target in sorted(graph[module]):
            theirs = floor_of(target, table)
            if own is not None and theirs is not None and theirs > own:
                found.append(f"{module} (floor {own}) imports {target} (floor {theirs})")
    return found


def test_package_inits_count_from_outside_only(tmp_path):
    (tmp_path / "m.py").write_text("from enginecore.frontend import step_loop\n")
    modules = {"enginecore.frontend": tmp_path / "__init__.py", "enginecore.m": tmp_path / "m.py",
               "enginecore.frontend.step_loop": tmp_path / "step_loop.py"}
    assert imports_of("enginecore.m", tmp_path / "m.py", modules) == {
        "enginecore.frontend", "enginecore.frontend.step_loop"}
    inside = tmp_path / "op.py"
    inside.write_text("from enginecore.frontend import step_loop\n")
    modules["enginecore.frontend.op"] = inside
    assert imports_of("enginecore.frontend.op", inside, modules) == {
        "enginecore.frontend.step_loop"}


def test_upward_imports_are_found():
    table = {"protocol": 0, "core": 3}
    graph = {"enginecore.protocol": {"enginecore.core.engine_core"},
             "enginecore.core.engine_core": {"enginecore.protocol"}}
    assert upward_imports(graph, table) == [
        "enginecore.protocol (floor 0) imports enginecore.core.engine_core (floor 3)"]


def test_every_module_has_a_floor():
    table = floors()
    missing = sorted(m for m in import_graph() if floor_of(m, table) is None)
    assert not missing, ("modules without a floor (add their room to the ```floors block of "
                         f"docs/architecture.md): {missing}")


def test_no_module_imports_from_a_higher_floor():
    found = upward_imports(import_graph(), floors())
    assert not found, "upward imports:\n  " + "\n  ".join(found)


def test_make_client_keeps_vllms_spelling():
    from enginecore.client import EngineCoreClient, make_client

    assert EngineCoreClient.make_client is make_client
