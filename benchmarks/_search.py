"""The partitioner's search caps as benchmark flags, shared by ``paper_throughput.py`` and
``scaling.py``. Not a benchmark itself.

``--max-simulations N`` caps the partitioner's replays per search (default: its own cap,
rpcompile.planner.partition.SIMULATION_CAPS): a capped search that stops before its proof
says so in the plan's notes, with the most a candidate it did not replay could be faster.
``--refine N`` caps the async boundary refinement's replays (default 16; 0 turns it off)."""

from __future__ import annotations

import argparse
from functools import partial
from typing import Any

from rpcompile.planner.partition import partition


def add_search_caps(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--max-simulations", type=int, default=None, metavar="N",
                    help="cap the partitioner's simulator replays per search (default: its "
                         "own cap; a search stopped before its proof says so)")
    ap.add_argument("--refine", type=int, default=None, metavar="N",
                    help="cap the async boundary refinement's simulator replays (default: "
                         "the partitioner's 16; 0 turns it off)")


def capped_partition(args: argparse.Namespace) -> Any:
    """``partition`` with the caps given on the command line (none: the partitioner's own)."""
    caps = {k: v for k, v in (("max_simulations", args.max_simulations),
                              ("refine", args.refine)) if v is not None}
    return partial(partition, **caps)


def search_note(plan: Any) -> str:
    """The plan's ``search:`` note (proven, or the gap of a capped search), or ''."""
    return next((n for n in plan.notes if n.startswith("search:")), "")
