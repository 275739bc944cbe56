"""The partitioner's search caps as benchmark flags, shared by ``paper_throughput.py`` and
``scaling.py``. Not a benchmark itself.

``--max-simulations N`` caps the partitioner's replays per search (default: the normal
search effort's, rpcompile.planner.partition.SEARCH_BUDGETS): a capped search that stops before its proof
says so in the plan's notes, with the most a candidate it did not replay could be faster.
``--refine N`` caps the async boundary refinement's replays (default 16; 0 turns it off, and
the class balancing that follows it: docs/partition.md, section 6). ``--max-tail-layers N``
lets the fused tail take up to N layers before the LM head (default 3: docs/partition.md,
section 7)."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import Any

from rpcompile.options import PlanOptions
from rpcompile.planner.partition import partition


def add_search_caps(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--max-simulations", type=int, default=None, metavar="N",
                    help="cap the partitioner's simulator replays per search (default: its "
                         "own cap; a search stopped before its proof says so)")
    ap.add_argument("--refine", type=int, default=None, metavar="N",
                    help="cap the async boundary refinement's simulator replays (default: "
                         "the partitioner's 16; 0 turns it and the class balancing "
                         "after it off)")
    ap.add_argument("--max-tail-layers", type=int, default=None, metavar="N",
                    help="let the fused tail take up to N layers before the LM head "
                         "(default: the partitioner's 3)")


def capped_partition(args: argparse.Namespace) -> Callable[..., Any]:
    """``partition`` with the caps given on the command line (none: the partitioner's own),
    called as the benchmarks call a partitioner (``partition_roundpipe``'s arguments, and
    ``optimizer``): the plan options travel as the group (``PlanOptions``, its
    ``max_simulations`` the cap), the refinement's cap and the tail's layers as the search
    keywords they are."""
    search = {} if args.refine is None else {"refine": args.refine}
    if args.max_tail_layers is not None:
        search["max_tail_layers"] = args.max_tail_layers

    def capped(units: Sequence[Any], hw: Any, workers: int, microbatches: int,
               microbatch_size: int = 1, seq_len: int = 1, rounds: int = 1,
               costing: Any = None, *, optimizer: str = "async") -> Any:
        options = PlanOptions(gpus=workers, microbatches=microbatches, rounds=rounds,
                              mode=optimizer, max_simulations=args.max_simulations)
        return partition(units, hw, microbatch_size=microbatch_size, seq_len=seq_len,
                         costing=costing, options=options, **search)

    return capped


def search_note(plan: Any) -> str:
    """The plan's ``search:`` note (proven, or the gap of a capped search), or ''."""
    return next((n for n in plan.notes if n.startswith("search:")), "")
