"""compile() keywords from options given by name, for test helpers that take a few options
of any group: each shortcut stays a keyword, every other option goes into its group."""

from __future__ import annotations

from typing import Any

from rpcompile.compiler import SHORTCUTS
from rpcompile.options import FLAT, CaptureOptions, PlanOptions, TrainOptions

_CLASSES = {"capture": CaptureOptions, "plan": PlanOptions, "train": TrainOptions}


def grouped(**options: Any) -> dict[str, Any]:
    """``compile(model, **grouped(gpus=2, chaos=3))`` is ``compile(model, gpus=2,
    train=TrainOptions(chaos=3))``; a name that is no option (``example_inputs``) passes."""
    out: dict[str, Any] = {}
    groups: dict[str, dict[str, Any]] = {}
    for name, value in options.items():
        if name in FLAT and name not in SHORTCUTS:
            groups.setdefault(FLAT[name], {})[name] = value
        else:
            out[name] = value
    out.update({g: _CLASSES[g](**kw) for g, kw in groups.items()})
    return out
