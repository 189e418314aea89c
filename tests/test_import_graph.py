"""The package imports downwards only. Between the subpackages and top-level modules of dion3
the import graph is acyclic; nothing outside dion3.tools imports the tools (the library never
needs them: `import dion3` loads none); inside dion3.distributed the modules' graph is acyclic
too.

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
    assert {"bucketing", "state", "bucket", "sharded", "replicated", "interleave"} <= set(graph)
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
    modules = {"interleave", "sharded"}
    source = ("import torch\nfrom .. import rules\nfrom dion3.distributed.sharded import run\n"
              "def f():\n    from . import interleave, Traffic\n    import dion3.distributed\n")
    assert imports_of(source, modules) == {"sharded", "interleave", "__init__"}


SRC = PACKAGE.parent  # src/dion3
TOOLS = "tools"


def unit_of(path: Path) -> str:
    """The node a source file belongs to: its subpackage (kernels, ortho, ...; tools/x for each
    tool) or its own name for a top-level module."""
    parts = path.relative_to(SRC).with_suffix("").parts
    if len(parts) == 1:
        return parts[0]
    return "/".join(parts[:2]) if parts[0] == TOOLS and len(parts) > 2 else parts[0]


def absolute_imports(path: Path) -> set[str]:
    """The dion3 modules a file imports anywhere, as dotted names below dion3 (relative imports resolved)."""
    package = list(path.relative_to(SRC).parent.parts)
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name[len("dion3."):] for a in node.names if a.name.startswith("dion3."))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            elif node.module and node.module.startswith("dion3"):
                target = node.module[len("dion3"):].lstrip(".")
            else:
                continue
            names = [a.name for a in node.names]
            candidates = [f"{target}.{n}" if target else n for n in names]
            found.update(c for c in candidates if _exists(c)) or None
            if not any(_exists(c) for c in candidates) and target:
                found.add(target)
    return found


def _exists(dotted: str) -> bool:
    base = SRC.joinpath(*dotted.split("."))
    return base.with_suffix(".py").exists() or (base / "__init__.py").exists()


def _unit_of_module(dotted: str) -> str:
    base = SRC.joinpath(*dotted.split("."))
    path = base.with_suffix(".py") if base.with_suffix(".py").exists() else base / "__init__.py"
    return unit_of(path)


def unit_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in SRC.rglob("*.py"):
        unit = unit_of(path)
        if path.name == "__init__.py" and path.parent == SRC:
            continue  # the package's face imports what it re-exports
        targets = {_unit_of_module(m) for m in absolute_imports(path) if m}
        graph.setdefault(unit, set()).update(t for t in targets if t != unit)
    return graph


def test_the_package_imports_downwards_only():
    graph = unit_graph()
    assert {"kernels", "ortho", "optim", "distributed", "rules", "tools/bench", "tools/plan", "tools/train"} <= set(graph)
    assert cycle(graph) == [], f"import cycle between subpackages: {' -> '.join(cycle(graph))}"
    upward = sorted((a, b) for a, targets in graph.items() for b in targets
                    if not a.startswith(TOOLS) and b.startswith(TOOLS))
    assert upward == [], f"library modules import the tools: {upward}"


def test_import_dion3_loads_no_tool_module():
    import subprocess
    import sys

    code = "import dion3, sys; print(sorted(m for m in sys.modules if m.startswith('dion3.')))"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "dion3." in loaded and "dion3.tools" not in loaded, loaded
