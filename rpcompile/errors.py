"""The root of every exception rpcompile raises on purpose.

``except rpcompile.RPCompileError`` catches any of them. Each error also keeps the built-in base
users already catch (``ValueError`` for a refused input, ``RuntimeError`` for a failure while
running, ``MemoryError``, ``TimeoutError``), so existing handlers keep working. Errors with a meaning of
their own have their own class where they are raised (``PartitionError``, ``StepFailed``, ...);
the four general ones below carry the rest.
"""

from __future__ import annotations

__all__ = ["InvalidInput", "InvalidType", "MissingKey", "RPCompileError", "StateError"]


class RPCompileError(Exception):
    """Base class of every exception rpcompile raises on purpose."""


class InvalidInput(RPCompileError, ValueError):
    """A value rpcompile refuses: an option, a batch, a model's structure, a file's content.
    The message names the value and what to change."""


class InvalidType(RPCompileError, TypeError):
    """An argument of a type rpcompile does not take."""


class StateError(RPCompileError, RuntimeError):
    """A call the current state does not allow (a closed trainer, a step while another runs),
    an environment that lacks what was asked for (a CUDA device, a package), or an internal
    check that failed. The message says which, and what to do."""


class MissingKey(RPCompileError, KeyError):
    """A name that is not where it was looked up (a parameter, a state entry)."""
