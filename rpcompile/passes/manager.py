"""A small pass manager: runs named passes in order, checks invariants after each, keeps history.

Each pass is a pure function artifact -> artifact. The manager times it, records the artifact it
produced (so every intermediate schedule stays reachable), and runs ``check(artifact, name)``
after it; a failing check raises and so names the pass that broke the invariant.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

__all__ = ["PassInvariantError", "PassManager", "PassRecord", "debug_checks", "run_pass"]

T = TypeVar("T")


@dataclass(frozen=True)
class PassRecord(Generic[T]):
    """One pass run: its name, wall time of the pass and of the check after it, its output."""

    name: str
    elapsed_ms: float
    check_ms: float
    artifact: T


class PassManager(Generic[T]):
    def __init__(self, passes: Sequence[tuple[str, Callable[[T], T]]],
                 check: Callable[[T, str], None] | None = None) -> None:
        names = [n for n, _ in passes]
        if len(set(names)) != len(names):
            raise ValueError(f"pass names must be unique, got {names}")
        self.passes = tuple(passes)
        self.check = check

    def run(self, artifact: T) -> tuple[T, tuple[PassRecord[T], ...]]:
        """Run every pass in order; returns the last artifact and one record per pass."""
        history: list[PassRecord[T]] = []
        for name, fn in self.passes:
            t0 = time.perf_counter()
            artifact = fn(artifact)
            t1 = time.perf_counter()
            if self.check is not None:
                self.check(artifact, name)
            t2 = time.perf_counter()
            history.append(PassRecord(name, (t1 - t0) * 1e3, (t2 - t1) * 1e3, artifact))
        return artifact, tuple(history)


# -- the compile's passes: one record each, invariant checks under RPCOMPILE_DEBUG=1 -----------


class PassInvariantError(AssertionError):
    """A pass produced an artifact that breaks one of its invariants (``RPCOMPILE_DEBUG=1``)."""


def debug_checks() -> bool:
    """Whether ``RPCOMPILE_DEBUG`` asks for every artifact's invariants to be checked."""
    return os.environ.get("RPCOMPILE_DEBUG", "").strip().lower() not in ("", "0", "false", "no")


def run_pass(history: list[PassRecord], name: str, fn: Callable[[], T],
             check: Callable[[T], None] | None = None) -> T:
    """Run one pass of the compile, append its :class:`PassRecord` (name, time, artifact) to
    ``history`` and, under ``RPCOMPILE_DEBUG=1``, check its artifact: a broken invariant
    raises :class:`PassInvariantError` naming the pass."""
    t0 = time.perf_counter()
    artifact = fn()
    t1 = time.perf_counter()
    if check is not None and debug_checks():
        try:
            check(artifact)
        except PassInvariantError:
            raise
        except Exception as exc:
            raise PassInvariantError(
                f"pass {name!r} produced an artifact that breaks its invariants: "
                f"{type(exc).__name__}: {exc}") from exc
    history.append(PassRecord(name, (t1 - t0) * 1e3, (time.perf_counter() - t1) * 1e3,
                              artifact))
    return artifact
