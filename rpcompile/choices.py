"""The options that take one of a few names, their choices, and the one check of them.

Every such option (``mode``, ``updates``, ``recompute``, ``device``, ``kernels``,
``host_memory``) has one tuple of choices here and one rule, :func:`check_option`: the option
groups (:mod:`rpcompile.options`, which re-exports all of this) check their fields with it,
and each lower layer that is public and takes the same value as a plain argument
(``make_workers(device=...)``, ``Hardware.with_host_memory``, ``resolve_backend``, the CLI's
flags through :func:`flag_type`, ``rpcompile train``'s ``--config`` file) calls it under its
own name for the value instead of a second copy of the rule, so a bad value reads the same
wherever it is refused. The planner's entries (``partition``, ``longest_sequence``) take the
``PlanOptions`` group, checked when it was built.

It imports nothing of rpcompile: both :mod:`rpcompile.hardware` and :mod:`rpcompile.options`
(which imports hardware) read it.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from rpcompile.errors import InvalidInput

__all__ = [
    "CHOICES",
    "DEVICES",
    "HOST_MEMORY",
    "KERNELS",
    "MODES",
    "RECOMPUTE_GRANULARITIES",
    "RECOMPUTE_MODES",
    "SEARCH_EFFORTS",
    "UPDATE_ORDERS",
    "check_choice",
    "check_option",
    "flag_type",
]

MODES = ("sync", "async")
DEVICES = ("auto", "cuda", "virtual")
KERNELS = ("auto", "torch", "triton")
# Where the host's side of every transfer lives: pinned memory, or pageable memory (copies
# through the driver's staging buffer).
HOST_MEMORY = ("pinned", "pageable")
UPDATE_ORDERS = ("overlap", "deferred")  # the sync update orders (rpcompile.passes.lower)
# How backward stages recompute their forward (rpcompile.passes.cost): the planner's choice,
# whole stages, or layer by layer.
RECOMPUTE_MODES = ("auto", "stage", "layer")
# What a backward stage does once the planner has resolved "auto" (rpcompile.passes.cost's
# figures, ``Stage.recompute``): a value, not an option, checked by the same rule.
RECOMPUTE_GRANULARITIES = tuple(m for m in RECOMPUTE_MODES if m != "auto")
# How much the partition search spends (rpcompile.planner.partition.SEARCH_BUDGETS).
SEARCH_EFFORTS = ("normal", "high", "exhaustive")

# option -> (its choices, what they mean: said after the choices when a value is refused)
CHOICES: dict[str, tuple[tuple[str, ...], str]] = {
    "mode": (MODES, "'sync': exact updates; 'async': step k's update overlaps step k+1, "
                    "one step stale"),
    "updates": (UPDATE_ORDERS, "the sync update order: each stage's update as soon as its "
                               "gradients are home, or after the step's last gradient"),
    "recompute": (RECOMPUTE_MODES, "how a backward stage recomputes its forward"),
    "device": (DEVICES, "'auto': CUDA when present, else virtual CPU workers"),
    "kernels": (KERNELS, "'auto': Triton on CUDA, the torch reference elsewhere"),
    "host_memory": (HOST_MEMORY, "the host memory transfers copy from and to"),
    "search_effort": (SEARCH_EFFORTS, "what the partition search spends: 'normal' stops at "
                                      "a few replays, 'high' at many, 'exhaustive' only "
                                      "once its plan is proven the fastest"),
}
_HINTS = {choices: hint for choices, hint in CHOICES.values()}
_HINTS[RECOMPUTE_GRANULARITIES] = ("a backward stage's recompute, resolved: 'auto' is the "
                                   "planner's choice between them")


def check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    """Refuse ``value`` unless it is one of ``choices``, naming ``name``, every choice and
    (for the choices of an option of :data:`CHOICES`) what they mean."""
    if value not in choices:
        hint = _HINTS.get(choices)
        raise InvalidInput(f"{name} must be one of {', '.join(map(repr, choices))}, got "
                         f"{value!r}" + (f" ({hint})" if hint else ""))


def check_option(option: str, value: Any, *, name: str | None = None) -> None:
    """The one check of ``option``'s value (:data:`CHOICES`); ``name``: what the caller calls
    the value, when not the option's name (``partition``'s ``optimizer`` is a ``mode``)."""
    check_choice(name or option, value, CHOICES[option][0])


def flag_type(option: str) -> Callable[[str], str]:
    """An argparse ``type`` checking a flag's value with ``option``'s one rule
    (:func:`check_option`): a bad value is refused with the message ``compile()`` gives,
    after argparse's ``argument --flag:``."""

    def parse(text: str) -> str:
        try:
            check_option(option, text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None
        return text

    parse.__name__ = option  # what argparse names in its own messages
    return parse
