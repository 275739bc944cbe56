"""``rpcompile.compile``: run the whole flow and keep every artifact on the result.

capture -> cost -> partition -> split -> dispatch -> lower; every artifact stays on ``Compiled``.
One module a concept: ``entry`` (compile() and its options), ``compiled`` (the result and its
planning for a batch shape), ``state`` (its state dicts, checkpoints and save_pretrained, a
base of Compiled), ``chunks`` (the loss-chunk variants), ``search`` (the partition search's
plan and the hardware planned on), ``shapes``, ``checks`` (the memory refusals) and
``profiles`` (the unit profiles the partitioner reads).
"""

from rpcompile.compiler.checks import MemoryPlanError, check_host_memory, check_memory
from rpcompile.compiler.compiled import Compiled
from rpcompile.compiler.entry import SHORTCUTS, compile
from rpcompile.compiler.profiles import unit_profiles
from rpcompile.compiler.search import planning_hardware
from rpcompile.options import update_order
from rpcompile.passes.lower import runtime_schedule

__all__ = ["SHORTCUTS", "Compiled", "MemoryPlanError", "check_host_memory", "check_memory",
           "compile", "planning_hardware", "runtime_schedule", "unit_profiles", "update_order"]
