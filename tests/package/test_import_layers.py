"""Import layering, read from the source: the bridge never reaches the viz layer and the weight
tools never reach the bridge, through any chain of qlens imports (function-level ones too)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "qlens"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def imported_modules(name: str) -> set[str]:
    """The qlens modules that module ``name`` imports anywhere in its source, with ``from X
    import y`` counting X and, where y is a module, X.y."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([node.module] if node.module else [])])
            found |= {base} | {f"{base}.{alias.name}" for alias in node.names}
    return {m for m in found if m in MODULES}


def reachable_from(prefix: str) -> dict[str, str]:
    """Every qlens module reachable by imports from the modules under ``prefix``, each with the
    module that first imported it (to print the chain)."""
    parent = {m: "" for m in MODULES if m == prefix or m.startswith(prefix + ".")}
    todo = list(parent)
    while todo:
        current = todo.pop()
        for imported in imported_modules(current):
            if imported not in parent:
                parent[imported] = current
                todo.append(imported)
    return parent


def chain(parent: dict[str, str], module: str) -> str:
    links = [module]
    while parent[links[-1]]:
        links.append(parent[links[-1]])
    return " <- ".join(links)


@pytest.mark.parametrize(
    ("lower", "upper"), [("qlens.bridge", "qlens.viz"), ("qlens.weights", "qlens.bridge")]
)
def test_lower_layer_never_imports_upper_layer(lower, upper):
    parent = reachable_from(lower)
    reached = [m for m in parent if m == upper or m.startswith(upper + ".")]
    assert not reached, f"{lower} imports {upper}: " + "; ".join(chain(parent, m) for m in reached)


def test_the_scan_sees_imports_inside_functions():
    # Bridge._repr_html_ imports qlens.rich_repr in its body; the viz layer imports the bridge's
    # cache at the top of its modules.
    assert "qlens.rich_repr" in imported_modules("qlens.bridge.bridge")
    assert "qlens.bridge.cache" in reachable_from("qlens.viz")


# The benchmarks folder as a package, and its helpers as the scripts import them.
BENCHMARK_MODULES = {"benchmarks", "_timing", "_samples", "_tinygemm", "_dynamo_guards"}


def test_the_package_never_imports_the_benchmarks():
    offenders = []
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            offenders += [(name, n) for n in names if n.split(".")[0] in BENCHMARK_MODULES]
    assert not offenders
