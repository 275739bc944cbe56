"""The data that flows between rpcompile's passes.

Modules, in reading order:
  plan       - UnitProfile (numeric cost of one unit for one microbatch); Stage, Plan (the
               RoundPipe partition: forward stages, the fused tail, backward stages)
  actions    - ActionKind and its records, streams, edge kinds; Action, Flow, Edge
  schedule   - Schedule (the schedule as data, docs/schedule.md), its dry run, ScheduleError
  serialize  - the schedule's CSV, JSON (Chrome trace), grid text and PNG forms and files

Everything here is a frozen value: passes build new ones instead of editing old ones, and the
string forms are meant to be read by people and parsed back by tests.
"""

from rpcompile.ir.actions import (
    ACTION_KINDS,
    ACTION_SPECS,
    BULK_PAYLOADS,
    COMPUTE_KINDS,
    EDGE_KINDS,
    HOST_KINDS,
    HOST_STREAMS,
    ORDERED_STREAMS,
    PAYLOADS,
    RELEASE_EDGES,
    STEPS_IN_FLIGHT,
    STREAMS,
    TRANSFER_KINDS,
    Action,
    ActionKind,
    Edge,
    Flow,
    KindSpec,
    check_registry,
)
from rpcompile.ir.plan import (
    BOUNDED_WAITS,
    STAGING_FIT,
    TIGHTEST_WAITS,
    Plan,
    Stage,
    StageKind,
    UnitProfile,
)
from rpcompile.ir.schedule import DryRun, Schedule, ScheduleError

__all__ = [
    "ACTION_KINDS",
    "ACTION_SPECS",
    "BOUNDED_WAITS",
    "BULK_PAYLOADS",
    "COMPUTE_KINDS",
    "EDGE_KINDS",
    "HOST_KINDS",
    "HOST_STREAMS",
    "ORDERED_STREAMS",
    "PAYLOADS",
    "RELEASE_EDGES",
    "STAGING_FIT",
    "STEPS_IN_FLIGHT",
    "STREAMS",
    "TIGHTEST_WAITS",
    "TRANSFER_KINDS",
    "Action",
    "ActionKind",
    "DryRun",
    "Edge",
    "Flow",
    "KindSpec",
    "Plan",
    "Schedule",
    "ScheduleError",
    "Stage",
    "StageKind",
    "UnitProfile",
    "check_registry",
]
