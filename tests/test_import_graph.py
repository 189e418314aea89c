"""The distributed package's modules import downwards only: their import graph is acyclic.

Every import statement counts, wherever it stands: at module level, inside a function, or under
`if TYPE_CHECKING:` (a type-only import still makes the importer depend on the imported module's
contents, and a cycle there is one refactor away from a circular import at run time). The
package's __init__ is a node too: a module that imports from its own package's facade imports
upwards.
"""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "dion3" / "distributed"
DOTTED = "dion3.distributed"


def imports_of(source: str, modules: set[str]) -> set[str]:
    """Sibling modules (names in `modules`, "__init__" for the package itself) that `source`,
    a module of the package, imports anywhere."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == DOTTED:
                    found.add("__init__")
                elif alias.name.startswith(DOTTED + "."):
                    found.add(alias.name[len(DOTTED) + 1 :].split(".")[0])
            continue
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level == 1:
            target = node.module
        elif node.level == 0 and node.module and (node.module == DOTTED or node.module.startswith(DOTTED + ".")):
            target = node.module[len(DOTTED) + 1 :] or None
        else:  # the parent package or another library
            continue
        if target:
            found.add(target.split(".")[0])
        else:  # `from . import x`: module x, or a name of the package's __init__
            found.update(alias.name if alias.name in modules else "__init__" for alias in node.names)
    return found & (modules | {"__init__"})


def cycle(graph: dict[str, set[str]]) -> list[str]:
    """One cycle of the directed graph as [a, b, ..., a], or [] when it is acyclic."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return []

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return []


def package_graph() -> dict[str, set[str]]:
    modules = {p.stem for p in PACKAGE.glob("*.py")}
    return {name: imports_of((PACKAGE / f"{name}.py").read_text(), modules) - {name} for name in modules}


def test_the_distributed_package_imports_downwards_only():
    graph = package_graph()
    assert {"plan", "state", "bucket", "sharded", "replicated", "interleave"} <= set(graph)
    assert cycle(graph) == [], f"import cycle: {' -> '.join(cycle(graph))}"


def test_a_type_only_import_back_is_a_cycle():
    """The check itself, on sources shaped like a planner and its state module that import each
    other, one of them only for type checking: a cycle, found in both directions."""
    modules = {"plan", "state", "mesh"}
    plan = "from .state import allocate\nfrom .mesh import MeshInfo\n"
    state = ("from typing import TYPE_CHECKING\nfrom .mesh import MeshInfo\n"
             "if TYPE_CHECKING:\n    from .plan import Bucket\n")
    graph = {"plan": imports_of(plan, modules), "state": imports_of(state, modules), "mesh": set()}
    assert graph == {"plan": {"state", "mesh"}, "state": {"mesh", "plan"}, "mesh": set()}
    assert cycle(graph) == ["plan", "state", "plan"]
    graph["state"].discard("plan")
    assert cycle(graph) == []


def test_imports_inside_functions_and_of_the_package_facade_count():
    modules = {"step", "pipeline"}
    source = ("import torch\nfrom .. import rules\nfrom dion3.distributed.pipeline import run\n"
              "def f():\n    from . import step, Traffic\n    import dion3.distributed\n")
    assert imports_of(source, modules) == {"pipeline", "step", "__init__"}
