"""rpcompile: compile any PyTorch model into a RoundPipe training program.

``rpcompile.compile(model, gpus=8)`` captures the model's training loss as a torch.fx graph,
costs it, cuts it into RoundPipe stages and builds one program per stage; every artifact stays
on the returned object.
"""

from rpcompile.capture import Captured, CaptureError, CaptureReport, capture
from rpcompile.compiler import Compiled, compile
from rpcompile.hardware import Hardware, get_hardware, list_hardware
from rpcompile.ir import Plan, Stage, UnitProfile
from rpcompile.passes.partition import PartitionError

__all__ = [
    "CaptureError",
    "CaptureReport",
    "Captured",
    "Compiled",
    "Hardware",
    "PartitionError",
    "Plan",
    "Stage",
    "UnitProfile",
    "capture",
    "compile",
    "get_hardware",
    "list_hardware",
]
