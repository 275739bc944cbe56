"""The README's layout block names every module and folder of the package as it is, and the
package's modules import each other without a circle."""

from __future__ import annotations

import ast
import re
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _layout_block() -> str:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Layout"):]
    return section[section.index("```\n") + 4:section.index("\n```", section.index("```\n") + 4)]


def test_the_readme_layout_names_every_module():
    block = _layout_block()
    words = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", block))
    pkg = ROOT / "rpcompile"
    missing = []
    for path in sorted(pkg.rglob("*.py")):
        if path.name == "__init__.py":
            continue
        if path.stem not in words:
            missing.append(str(path.relative_to(ROOT)))
    folders = {p.parent.relative_to(pkg).parts[0] for p in pkg.rglob("*.py")
               if p.parent != pkg and p.parent.name != "__pycache__"}
    missing += [f"rpcompile/{f}/" for f in sorted(folders) if f"{f}/" not in block]
    missing += [str(p.relative_to(ROOT)) for p in sorted(pkg.rglob("configs/*.json"))
                if "configs/" not in block]
    assert not missing, f"README.md's layout block does not name: {missing}"


def _reexports(pkg: Path) -> dict[str, str]:
    """``package.name`` -> ``module.name`` for each name a package's ``__init__`` imports from
    one of its modules, so that importing it from the package depends on that module."""
    out = {}
    for init in pkg.rglob("__init__.py"):
        package = ".".join(init.parent.relative_to(ROOT).parts)
        for node in ast.parse(init.read_text()).body:
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                out.update({f"{package}.{a.asname or a.name}": f"{node.module}.{a.name}"
                            for a in node.names})
    return out


def _imports(path: Path, modules: set[str], reexports: dict[str, str]) -> set[str]:
    """The package modules ``path`` imports, at module level or inside a function (a lazy
    import is still a dependency); imports only for type checkers are not. A name imported
    from a package counts as imported from the module the package takes it from."""

    def owner(name: str) -> str | None:
        seen = set()
        while name in reexports and name not in seen:
            seen.add(name)
            name = reexports[name]
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    found = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            if isinstance(child, ast.Import):
                found.update(owner(a.name) for a in child.names)
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                found.update(owner(f"{child.module}.{a.name}") for a in child.names)
            visit(child)

    visit(ast.parse(path.read_text()))
    return found


def test_the_package_imports_without_a_circle():
    pkg = ROOT / "rpcompile"
    files = {".".join(p.relative_to(ROOT).with_suffix("").parts): p for p in pkg.rglob("*.py")
             if p.name != "__init__.py"}  # a package's __init__ re-exports; it is no layer
    reexports = _reexports(pkg)
    graph = {name: _imports(path, set(files), reexports) - {None, name}
             for name, path in files.items()}
    assert sum(map(len, graph.values())) > 100  # the walk sees the package's imports
    try:
        tuple(TopologicalSorter(graph).static_order())
    except CycleError as e:
        raise AssertionError(f"modules importing each other: {' -> '.join(e.args[1])}") from e
