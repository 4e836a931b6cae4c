"""The package's shape: its modules import one another in one direction only."""

from __future__ import annotations

import ast
from pathlib import Path

import vit_explorer

PACKAGE = Path(vit_explorer.__file__).parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_graph() -> dict[str, set[str]]:
    """module -> the package's modules it imports anywhere (type hints and function bodies too)."""
    paths = {_module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        imported = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                imported.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*parent, *([node.module] if node.module else [])])
                # "from . import x" imports the module x when there is one, else a name of base.
                modules = {f"{base}.{alias.name}" for alias in node.names} & paths.keys()
                imported.update(modules or {base})
        graph[name] = {module for module in imported if module in paths and module != name}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (its modules in import order, the first again at the end)."""
    state: dict[str, str] = {}  # "open" while its imports are walked, then "done"
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = "open"
        path.append(module)
        for imported in sorted(graph[module]):
            if state.get(imported) == "open":
                return path[path.index(imported):] + [imported]
            if imported not in state and (found := visit(imported)):
                return found
        path.pop()
        state[module] = "done"
        return None

    for module in sorted(graph):
        if module not in state and (found := visit(module)):
            return found
    return None


def test_the_import_graph_is_read():
    graph = _import_graph()
    assert "vit_explorer.model" in graph["vit_explorer.capture"]
    assert "vit_explorer.weights.checks" in graph["vit_explorer.weights.infer"]
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_no_module_of_the_package_imports_itself_back():
    cycle = _cycle(_import_graph())
    assert cycle is None, f"import cycle: {' -> '.join(cycle)}"
