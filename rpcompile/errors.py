"""The root of every exception rpcompile raises on purpose.

``except rpcompile.RPCompileError`` catches any of them. Each error also keeps the built-in base
users already catch (``ValueError`` for a refused input, ``RuntimeError`` for a failure while
running, ``MemoryError``, ``TimeoutError``), so existing handlers keep working.
"""

from __future__ import annotations

__all__ = ["RPCompileError"]


class RPCompileError(Exception):
    """Base class of every exception rpcompile raises on purpose."""
