"""The package's floors: every import, at module level or inside a function (``TYPE_CHECKING``
blocks apart, which never run), goes from a package to one on a lower floor or within its own
package, and no chain of imports between modules comes back to where it started."""

from __future__ import annotations

import ast
from pathlib import Path

import quantizer

PACKAGE = Path(quantizer.__file__).parent

FLOORS = ["version", "errors", "integrity", "memory", "schema", "native", "methods", "io", "formats", "calibrate",
          "quantization", "runtime", "verification", "hub", "integrations", "api", "cli", "__main__"]
"""Lowest first. The root ``quantizer/__init__.py`` (it only names the API, lazily) stands above all."""


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def type_checking_nodes(tree: ast.AST) -> set[int]:
    skipped = set()
    for node in ast.walk(tree):
        test = getattr(node, "test", None)
        if isinstance(node, ast.If) and getattr(test, "id", getattr(test, "attr", None)) == "TYPE_CHECKING":
            skipped.update(id(n) for child in node.body for n in ast.walk(child))
    return skipped


def imported_modules(name: str, path: Path) -> set[str]:
    """The int4q modules ``name`` imports anywhere in its file."""
    tree = ast.parse(path.read_text())
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    skipped, found = type_checking_nodes(tree), set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            source = ".".join(base + ([node.module] if node.module else []))
            for alias in node.names:
                found.add(f"{source}.{alias.name}" if f"{source}.{alias.name}" in MODULES else source)
    return {m for m in found if m in MODULES and m != name}


GRAPH = {name: imported_modules(name, path) for name, path in MODULES.items()}


def floor(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def test_every_top_level_module_and_package_has_a_floor():
    assert {floor(m) for m in MODULES} - {None} == set(FLOORS)


def test_no_package_imports_one_on_a_higher_floor():
    upward = sorted(f"{a} -> {b}" for a, targets in GRAPH.items() for b in targets
                    if floor(a) is not None and floor(b) is not None and floor(a) != floor(b)
                    and FLOORS.index(floor(b)) > FLOORS.index(floor(a)))
    assert upward == []


def test_only_the_root_reaches_the_root():
    assert sorted(a for a, targets in GRAPH.items() if "quantizer" in targets) == []


def test_no_import_cycles():
    cycles, done, path = [], set(), []

    def visit(module):
        path.append(module)
        for target in sorted(GRAPH[module]):
            if target in path:
                cycles.append(path[path.index(target):] + [target])
            elif target not in done:
                visit(target)
        path.pop()
        done.add(module)

    for module in sorted(GRAPH):
        if module not in done:
            visit(module)
    assert cycles == []


def test_the_walker_sees_function_level_imports():
    """A lazy import inside a function is an edge like any other."""
    assert "quantizer.native.library" in GRAPH["quantizer.native.checked"]
