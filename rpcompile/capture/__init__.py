"""Capture: a model and a batch become one loss graph (``core``), with the batch layer
(``batch``: binding, splitting, checks) and seeded dropout replay (``dropout``)."""

from rpcompile.capture.core import (
    B,
    Captured,
    CaptureError,
    CaptureReport,
    NoLossError,
    RefusedModel,
    S,
    capture,
    is_causal_lm,
)

__all__ = [
    "B",
    "CaptureError",
    "CaptureReport",
    "Captured",
    "NoLossError",
    "RefusedModel",
    "S",
    "capture",
    "is_causal_lm",
]
