"""Every exception rpcompile raises on purpose derives from one root, ``RPCompileError``, and
keeps the built-in base users already catch."""

import ast
import importlib
import inspect
import pkgutil
from pathlib import Path

import pytest

import rpcompile
from rpcompile import RPCompileError


def _library_exceptions() -> set[type[BaseException]]:
    found = set()
    for info in pkgutil.walk_packages(rpcompile.__path__, "rpcompile."):
        if info.name.endswith("__main__"):
            continue  # running it parses the command line
        module = importlib.import_module(info.name)
        for obj in vars(module).values():
            if (
                inspect.isclass(obj)
                and issubclass(obj, Exception)
                and not issubclass(obj, Warning)
                and obj.__module__.startswith("rpcompile.")
                and not obj.__name__.startswith("_")  # private control flow, never escapes
            ):
                found.add(obj)
    return found


def test_every_public_exception_derives_from_the_root():
    classes = _library_exceptions()
    assert len(classes) > 20  # the walk found the package's errors
    outside = sorted(c.__qualname__ for c in classes if not issubclass(c, RPCompileError))
    assert not outside, f"exceptions not derived from RPCompileError: {outside}"


@pytest.mark.parametrize(
    ("name", "builtin"),
    [
        ("PartitionError", ValueError),
        ("MemoryPlanError", ValueError),
        ("RefusedModel", ValueError),
        ("CaptureError", RuntimeError),
        ("StepFailed", RuntimeError),
        ("StepTimeout", TimeoutError),
        ("WorkerOutOfMemory", MemoryError),
        ("PassInvariantError", AssertionError),
        ("CheckpointError", ValueError),
    ],
)
def test_the_builtin_bases_users_catch_are_kept(name, builtin):
    cls = getattr(rpcompile, name)
    assert issubclass(cls, RPCompileError)
    assert issubclass(cls, builtin)



BUILTINS = {"ValueError", "TypeError", "RuntimeError", "KeyError", "IndexError", "TimeoutError",
            "AssertionError", "MemoryError", "Exception"}


def test_the_package_raises_its_own_errors_only():
    # A built-in exception raised by the library would escape `except RPCompileError`. (A bare
    # `raise NotImplementedError` in an abstract method is a contract, not an error.)
    root = Path(rpcompile.__file__).parent
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Raise) and node.exc is not None:
                exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
                if isinstance(exc, ast.Name) and exc.id in BUILTINS:
                    found.append(f"{path.relative_to(root.parent)}:{node.lineno} {exc.id}")
    assert len(list(root.rglob("*.py"))) > 50
    assert not found, "built-in exceptions raised: " + ", ".join(found)


def test_one_except_clause_catches_a_refused_option():
    import torch

    with pytest.raises(RPCompileError, match="gpus"):
        rpcompile.compile(torch.nn.Linear(2, 2), gpus=0)
