"""The package's shape: a folder per layer, imports running down the layers only, and no import cycle."""

from __future__ import annotations

import ast
from pathlib import Path

import vit_explorer

PACKAGE = Path(vit_explorer.__file__).parent
# The layers from the bottom up (ARCHITECTURE.md): a module imports from its own layer and those below.
LAYERS = ("model", "data", "weights", "analysis", "features", "text", "training", "serving", "figures", "app", "cli")
# Modules of the package's root that belong to no layer: anything may import them, they import nothing.
SHARED = ("vit_explorer.resources",)


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
    assert "vit_explorer.model.vit" in graph["vit_explorer.model.capture"]
    assert "vit_explorer.weights.checks" in graph["vit_explorer.weights.infer"]
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_no_module_of_the_package_imports_itself_back():
    cycle = _cycle(_import_graph())
    assert cycle is None, f"import cycle: {' -> '.join(cycle)}"


def _layer(module: str) -> int | None:
    """The rank of ``module``'s layer in LAYERS; None for the package itself (its public API) and
    its entry point, which sit above everything."""
    parts = module.split(".")
    if len(parts) == 1 or parts[1] == "__main__":
        return None
    return LAYERS.index(parts[1])


def test_every_folder_and_root_module_is_a_known_layer():
    entries = {path.stem for path in PACKAGE.iterdir() if path.suffix == ".py" or (path / "__init__.py").exists()}
    assert entries - {"__init__", "__main__"} == set(LAYERS) | {name.rpartition(".")[2] for name in SHARED}


def _upward(graph: dict[str, set[str]]) -> list[str]:
    """Every import of ``graph`` that runs up the layers (or into the package's public API)."""
    return [
        f"{module} -> {imported}"
        for module, imports in sorted(graph.items()) if module not in SHARED and _layer(module) is not None
        for imported in sorted(imports)
        if imported not in SHARED and (_layer(imported) is None or _layer(imported) > _layer(module))
    ]


def test_an_import_running_up_the_layers_is_caught():
    graph = {"vit_explorer.model.vit": {"vit_explorer.analysis.rollout", "vit_explorer.resources"},
             "vit_explorer.analysis.rollout": {"vit_explorer.model.vit", "vit_explorer"}}
    assert _upward(graph) == ["vit_explorer.analysis.rollout -> vit_explorer",
                              "vit_explorer.model.vit -> vit_explorer.analysis.rollout"]


def test_imports_run_down_the_layers():
    graph = _import_graph()
    assert not _upward(graph), f"imports running up the layers: {_upward(graph)}"
    assert all(not graph[module] for module in SHARED), "a shared root module imports the package"
