"""The one pass mechanism of the compile: every pass (capture, chunk-loss, cost, partition,
split, dispatch and each lowering pass) runs through :func:`run_pass`, alone or as a
:class:`PassManager`'s sequence.

Each pass is a pure function artifact -> artifact. :func:`run_pass` times it, appends a
:class:`PassRecord` (name, time, artifact) to the history it is given (``Compiled.history``
for a compile, so every intermediate artifact stays reachable), and checks the artifact's
invariants: under ``RPCOMPILE_DEBUG=1`` always, otherwise only for a check marked
``always``. A failing check raises :class:`PassInvariantError` naming the pass; a
schedule's check raises :class:`ScheduleInvariantError`, which is both that and a
:class:`~rpcompile.ir.ScheduleError` (the marked step x worker grid).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from rpcompile.errors import InvalidInput, RPCompileError
from rpcompile.ir import ScheduleError

__all__ = ["PassInvariantError", "PassManager", "PassRecord", "ScheduleInvariantError",
           "debug_checks", "run_pass"]

T = TypeVar("T")


@dataclass(frozen=True)
class PassRecord(Generic[T]):
    """One pass run: its name, wall time of the pass and of the check after it (0 when not
    checked), its output."""

    name: str
    elapsed_ms: float
    check_ms: float
    artifact: T


class PassInvariantError(RPCompileError, AssertionError):
    """A pass produced an artifact that breaks one of its invariants; the message names the
    pass (checked under ``RPCOMPILE_DEBUG=1``, and always for a lowered schedule)."""


class ScheduleInvariantError(PassInvariantError, ScheduleError):
    """A pass produced a schedule that breaks its invariants: a :class:`PassInvariantError`
    naming the pass, and a :class:`~rpcompile.ir.ScheduleError` showing the marked grid."""


def debug_checks() -> bool:
    """Whether ``RPCOMPILE_DEBUG`` asks for every artifact's invariants to be checked."""
    return os.environ.get("RPCOMPILE_DEBUG", "").strip().lower() not in ("", "0", "false", "no")


def run_pass(history: list[PassRecord], name: str, fn: Callable[[], T],
             check: Callable[[T], None] | None = None, *, always: bool = False) -> T:
    """Run one pass, append its :class:`PassRecord` (name, time, artifact) to ``history``
    and check its artifact with ``check`` under ``RPCOMPILE_DEBUG=1`` (``always``: whatever
    the environment says): a broken invariant raises :class:`PassInvariantError` naming the
    pass (:class:`ScheduleInvariantError` for a schedule's)."""
    t0 = time.perf_counter()
    artifact = fn()
    t1 = time.perf_counter()
    checked = check is not None and (always or debug_checks())
    if checked:
        try:
            check(artifact)
        except PassInvariantError:
            raise
        except Exception as exc:
            kind = ScheduleInvariantError if isinstance(exc, ScheduleError) else \
                PassInvariantError
            raise kind(f"pass {name!r} produced an artifact that breaks its invariants: "
                       f"{type(exc).__name__}: {exc}") from exc
    check_ms = (time.perf_counter() - t1) * 1e3 if checked else 0.0
    history.append(PassRecord(name, (t1 - t0) * 1e3, check_ms, artifact))
    return artifact


class PassManager(Generic[T]):
    """Named passes run in order through :func:`run_pass`, each on the last one's artifact.

    ``check(artifact, name)`` runs after each pass (under ``RPCOMPILE_DEBUG=1``, or always
    with ``always=True``)."""

    def __init__(self, passes: Sequence[tuple[str, Callable[[T], T]]],
                 check: Callable[[T, str], None] | None = None, *,
                 always: bool = False) -> None:
        names = [n for n, _ in passes]
        if len(set(names)) != len(names):
            raise InvalidInput(f"pass names must be unique, got {names}")
        self.passes = tuple(passes)
        self.check = check
        self.always = always

    def run(self, artifact: T, history: list[PassRecord] | None = None
            ) -> tuple[T, tuple[PassRecord[T], ...]]:
        """Run every pass in order; returns the last artifact and one record per pass (also
        appended to ``history`` when given: a compile's records and these are one list)."""
        records: list[PassRecord[T]] = []
        for name, fn in self.passes:
            check = None if self.check is None else (
                lambda a, _name=name: self.check(a, _name))
            artifact = run_pass(records, name, lambda fn=fn, a=artifact: fn(a), check,
                                always=self.always)
        if history is not None:
            history.extend(records)
        return artifact, tuple(records)
