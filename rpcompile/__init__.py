"""rpcompile: compile any PyTorch model into a RoundPipe training program.

``rpcompile.compile(model, gpus=8)`` captures the model's training loss as a torch.fx graph,
costs it, cuts it into RoundPipe stages and builds one program per stage; every artifact stays
on the returned object.
"""

from rpcompile.capture import Captured, CaptureError, CaptureReport, capture
from rpcompile.compiler import Compiled, compile
from rpcompile.hardware import Hardware, get_hardware, list_hardware
from rpcompile.ir import Action, Plan, Schedule, Stage, UnitProfile
from rpcompile.passes.lower import lower
from rpcompile.passes.partition import PartitionError
from rpcompile.passes.schedule import build_schedule
from rpcompile.runtime.checkpoint import CheckpointError, CheckpointManager
from rpcompile.runtime.executor import StepFailed, StepTimeout

__all__ = [
    "Action",
    "CaptureError",
    "CaptureReport",
    "Captured",
    "CheckpointError",
    "CheckpointManager",
    "Compiled",
    "Hardware",
    "PartitionError",
    "Plan",
    "Schedule",
    "Stage",
    "StepFailed",
    "StepTimeout",
    "UnitProfile",
    "build_schedule",
    "capture",
    "compile",
    "get_hardware",
    "list_hardware",
    "lower",
]
