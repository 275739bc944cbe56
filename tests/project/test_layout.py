"""The folders show the flow: every import (function-level ones included) runs down the layers,
and no module reaches itself through its imports.

    base      ir, errors, choices, options, hardware, _draw, progress   (the data everyone reads)
    capture   capture/                          (model + batch -> loss graph)
    passes    passes/                           (pure graph and schedule passes)
    sim       sim/                              (times a lowered schedule)
    planner   planner/                          (partition search, ranked by the dispatch model)
    runtime   runtime/                          (workers, executor, optimizer, trainer, reference)
    outer     workloads/, data/, viz            (shipped models, data files, pictures)
    compiler  compiler, plan_policy, rpcompile/__init__  (the flow; what plan plans for)
    apps      finetune, run_folder, interrupts, cli, __main__, trl  (jobs, the command line,
              the TRL front end)
"""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "rpcompile"

LAYERS = [
    ("base", ["rpcompile.ir", "rpcompile.errors", "rpcompile.choices", "rpcompile.options",
              "rpcompile.hardware", "rpcompile._draw", "rpcompile.progress"]),
    ("capture", ["rpcompile.capture"]),
    ("passes", ["rpcompile.passes"]),
    ("sim", ["rpcompile.sim"]),
    ("planner", ["rpcompile.planner"]),
    ("runtime", ["rpcompile.runtime"]),
    ("outer", ["rpcompile.workloads", "rpcompile.data", "rpcompile.viz"]),
    ("compiler", ["rpcompile.compiler", "rpcompile.plan_policy", "rpcompile"]),
    ("apps", ["rpcompile.finetune", "rpcompile.run_folder", "rpcompile.interrupts",
              "rpcompile.cli", "rpcompile.__main__", "rpcompile.trl"]),
]


def _modules() -> dict[str, Path]:
    out = {}
    for p in PKG.rglob("*.py"):
        parts = p.relative_to(PKG.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = p
    return out


def _layer(module: str) -> int:
    best = None
    for i, (_, prefixes) in enumerate(LAYERS):
        for pre in prefixes:
            if module == pre or module.startswith(pre + "."):
                if best is None or len(pre) > best[1]:
                    best = (i, len(pre))
    assert best is not None, f"{module} is in no layer: add it to tests/project/test_layout.py LAYERS"
    return best[0]


def _runtime_nodes(tree: ast.AST):
    """Every node but those under ``if TYPE_CHECKING:`` (annotations only, never run)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                todo.extend(child.orelse)
                continue
            todo.append(child)


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    found = set()
    for node in _runtime_nodes(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        for n in names:
            if n.startswith("rpcompile"):
                # the deepest module this name is (``from pkg import submodule`` included)
                while n not in modules and "." in n:
                    n = n.rsplit(".", 1)[0]
                if n in modules:
                    found.add(n)
    return found


def test_every_import_runs_down_the_layers():
    modules = _modules()
    wrong = []
    for name, path in sorted(modules.items()):
        for dep in sorted(_imports(path, modules) - {name}):
            if _layer(dep) > _layer(name):
                wrong.append(f"{name} ({LAYERS[_layer(name)][0]}) imports {dep} "
                             f"({LAYERS[_layer(dep)][0]})")
    assert not wrong, "imports against the flow:\n" + "\n".join(wrong)


def test_no_import_cycles():
    modules = _modules()
    graph = {m: _imports(p, modules) - {m} for m, p in modules.items()}
    # A package's __init__ that re-exports its own modules is not a cycle with them.
    for m in graph:
        graph[m] = {d for d in graph[m] if not m.startswith(d + ".")}
    state: dict[str, int] = {}
    cycles = []

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                cycles.append(" -> ".join([*path[path.index(d):], d]))
            elif d not in state:
                visit(d, [*path, d])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_the_readme_layout_block_names_every_folder():
    readme = (PKG.parent / "README.md").read_text()
    block = readme[readme.index("## Layout"):]
    folders = sorted(p.name for p in PKG.iterdir() if p.is_dir() and (p / "__init__.py").exists())
    missing = [f for f in folders if f"{f}/" not in block]
    assert not missing, f"README's layout block does not name {missing}"


def test_no_benchmark_shadows_a_module_a_library_imports():
    # `python benchmarks/X.py` puts benchmarks/ first on sys.path, so a script named like a
    # module a library probes for shadows it: benchmarks/kernels.py made transformers (which
    # imports the `kernels` package when it finds one) fail to load any model class.
    import subprocess
    import sys

    code = ("import sys; sys.path.insert(0, 'benchmarks'); import transformers; "
            "transformers.Qwen3ForCausalLM; import torch, triton, sympy")
    done = subprocess.run([sys.executable, "-c", code], cwd=PKG.parent, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
