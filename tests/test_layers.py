"""The import structure of src: no import cycle among its modules, imports inside functions included, the
weights code in layers that import one way only: names <- files <- loading, convert <- pretrained, and the file
helpers (atomic_file, download) importing nothing project-specific but src.errors.

The imports are read from the source (ast), so nothing is imported here and an import hidden in a function
counts like one at the top of a module.
"""
import ast
from pathlib import Path
from typing import Dict, List, Optional, Set

from conftest import REPO

# What each module of src/weights may import from src/weights.
WEIGHTS_LAYERS: Dict[str, Set[str]] = {
    "src.weights": set(),
    "src.weights.names": set(),
    "src.weights.files": {"src.weights.names"},
    "src.weights.loading": {"src.weights.names", "src.weights.files"},
    "src.weights.convert": {"src.weights.names", "src.weights.files"},
    "src.weights.pretrained": {"src.weights.names", "src.weights.files", "src.weights.loading"},
}
# Helpers every writer and downloader uses (src.weights included): they import no more of src than this.
HELPERS: Dict[str, Set[str]] = {
    "src.atomic_file": {"src.errors"},
    "src.download": {"src.atomic_file", "src.errors"},
}
# The applications built on the weights code, which it must not reach back into.
APPLICATIONS = {"src.trainer", "src.evaluation", "src.exporting", "src.inference"}
FRAMEWORKS = {"mindspore", "torch", "torchvision", "numpy"}


def src_modules(repo: Path = REPO) -> Dict[str, Path]:
    """Dotted name -> file of every module and package under repo/src."""
    modules = {}
    for path in sorted((repo / "src").rglob("*.py")):
        parts = list(path.relative_to(repo).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def imported_names(module: str, path: Path) -> Set[str]:
    """Every dotted name path imports anywhere in the file (functions included): for 'from a.b import c', both
    a.b and a.b.c (c may be a module). Relative imports are resolved against module's package."""
    names = set()
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else [])) \
                if node.level else node.module
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def import_graph(repo: Path = REPO) -> Dict[str, Set[str]]:
    """src module -> the src modules it imports."""
    modules = src_modules(repo)
    return {module: {name for name in imported_names(module, path) if name in modules} - {module}
                    for module, path in modules.items()}


def format_graph(graph: Dict[str, Set[str]]) -> str:
    """One line per module: 'module -> imported, ...'."""
    return "\n".join(f"{module} -> {', '.join(sorted(graph[module]))}" for module in sorted(graph))


def find_cycle(graph: Dict[str, Set[str]]) -> Optional[List[str]]:
    """A list of modules [a, b, ..., a] that import each other in a circle, None if there is none."""
    done: Set[str] = set()
    path: List[str] = []

    def visit(module: str) -> Optional[List[str]]:
        if module in path:
            return path[path.index(module):] + [module]
        if module in done:
            return None
        path.append(module)
        for imported in sorted(graph.get(module, ())):
            cycle = visit(imported)
            if cycle:
                return cycle
        path.pop()
        done.add(module)
        return None

    for module in sorted(graph):
        cycle = visit(module)
        if cycle:
            return cycle
    return None


def test_no_import_cycle_among_src_modules():
    graph = import_graph()
    cycle = find_cycle(graph)
    assert cycle is None, f"import cycle: {' -> '.join(cycle)}; the imports of src:\n{format_graph(graph)}"


def test_weights_layers_import_one_way():
    graph = import_graph()
    weights = {module for module in graph if module.split(".")[:2] == ["src", "weights"]}
    assert weights == set(WEIGHTS_LAYERS), "give every module of src/weights its place in WEIGHTS_LAYERS"
    for module in sorted(weights):
        inside = graph[module] & weights
        assert inside <= WEIGHTS_LAYERS[module], f"{module} imports {sorted(inside - WEIGHTS_LAYERS[module])}"
        assert not graph[module] & APPLICATIONS, f"{module} imports {sorted(graph[module] & APPLICATIONS)}"


def test_file_helpers_import_nothing_project_specific():
    graph = import_graph()
    for module, allowed in HELPERS.items():
        assert graph[module] <= allowed, f"{module} imports {sorted(graph[module] - allowed)}"


def test_weight_names_need_no_framework():
    """src.weights.names and what it imports from src are pure name handling: no MindSpore, torch or numpy."""
    graph, modules = import_graph(), src_modules()
    reached, todo = set(), ["src.weights.names"]
    while todo:
        module = todo.pop()
        if module not in reached:
            reached.add(module)
            todo.extend(graph[module])
    for module in sorted(reached):
        frameworks = {name.split(".")[0] for name in imported_names(module, modules[module])} & FRAMEWORKS
        assert not frameworks, f"{module} imports {sorted(frameworks)}"


def test_the_graph_sees_imports_inside_functions(tmp_path):
    """The checks above can fail: a back-import hidden in a function is a cycle here."""
    (tmp_path / "src" / "weights").mkdir(parents=True)
    (tmp_path / "src" / "__init__.py").write_text("")
    (tmp_path / "src" / "weights" / "__init__.py").write_text("")
    (tmp_path / "src" / "weights" / "names.py").write_text("def f():\n    from . import files\n")
    (tmp_path / "src" / "weights" / "files.py").write_text("from src.weights import names\n")
    graph = import_graph(tmp_path)
    assert graph["src.weights.names"] == {"src.weights", "src.weights.files"}
    assert find_cycle(graph) == ["src.weights.files", "src.weights.names", "src.weights.files"]
