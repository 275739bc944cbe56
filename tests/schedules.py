"""Helpers of the tests that compare a compile's schedule with a lowering of its plan."""

from __future__ import annotations

from rpcompile.ir import Schedule


def without_staging(sched: Schedule) -> Schedule:
    """``sched`` without its host staging slots and their ``reuse`` waits: what the last
    lowering pass gave before the staging pass (rpcompile.passes.staging) added them."""
    return sched.replace(edges=tuple(e for e in sched.edges if e.kind != "reuse"), staging=(),
                         staging_bytes=())
