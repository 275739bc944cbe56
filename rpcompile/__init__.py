"""rpcompile: compile any PyTorch model into a RoundPipe training program.

``rpcompile.compile(model, gpus=8)`` captures the model's training loss as a torch.fx graph,
costs it, cuts it into RoundPipe stages and builds one program per stage; every artifact stays
on the returned object. Its options come in three groups (:mod:`rpcompile.options`).
"""

from rpcompile.capture.core import capture
from rpcompile.capture.types import (
    Captured,
    CaptureError,
    CaptureReport,
    NoLossError,
    RefusedModel,
)
from rpcompile.compiler import Compiled, MemoryPlanError, compile
from rpcompile.data.formats import DataError
from rpcompile.errors import InvalidInput, InvalidType, MissingKey, RPCompileError, StateError
from rpcompile.hardware import Hardware, get_hardware, list_hardware
from rpcompile.ir import Action, Plan, Schedule, ScheduleError, Stage, UnitProfile
from rpcompile.options import CaptureOptions, LossScaleConfig, Options, PlanOptions, TrainOptions
from rpcompile.passes.lower import lower
from rpcompile.passes.manager import PassInvariantError, ScheduleInvariantError
from rpcompile.passes.memory import HostMemoryError, HostMemoryWarning
from rpcompile.passes.schedule import build_schedule
from rpcompile.planner.partition import PartitionError
from rpcompile.runtime.checkpoint import CheckpointError, CheckpointFailed, CheckpointManager
from rpcompile.runtime.distributed import RankFailed
from rpcompile.runtime.errors import (
    EventTimeout,
    OptimizerError,
    RuntimeFault,
    StagingError,
    UpstreamFailed,
    WorkerError,
    WorkerOutOfMemory,
)
from rpcompile.runtime.executor import StepAborted, StepFailed, StepTimeout
from rpcompile.runtime.trainer import Trainer
from rpcompile.sim.engine import SimulationError

__all__ = [
    "Action",
    "CaptureError",
    "CaptureOptions",
    "CaptureReport",
    "Captured",
    "CheckpointError",
    "CheckpointFailed",
    "CheckpointManager",
    "Compiled",
    "DataError",
    "EventTimeout",
    "Hardware",
    "HostMemoryError",
    "HostMemoryWarning",
    "InvalidInput",
    "InvalidType",
    "LossScaleConfig",
    "MemoryPlanError",
    "MissingKey",
    "NoLossError",
    "OptimizerError",
    "Options",
    "PartitionError",
    "PassInvariantError",
    "Plan",
    "PlanOptions",
    "RPCompileError",
    "RankFailed",
    "RefusedModel",
    "RuntimeFault",
    "Schedule",
    "ScheduleError",
    "ScheduleInvariantError",
    "SimulationError",
    "Stage",
    "StagingError",
    "StateError",
    "StepAborted",
    "StepFailed",
    "StepTimeout",
    "TrainOptions",
    "Trainer",
    "UnitProfile",
    "UpstreamFailed",
    "WorkerError",
    "WorkerOutOfMemory",
    "build_schedule",
    "capture",
    "compile",
    "get_hardware",
    "list_hardware",
    "lower",
]
