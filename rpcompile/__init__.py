"""rpcompile: compile any PyTorch model into a RoundPipe training program."""

from rpcompile.hardware import Hardware, get_hardware, list_hardware
from rpcompile.ir import Plan, Stage, UnitProfile

__all__ = ["Hardware", "Plan", "Stage", "UnitProfile", "get_hardware", "list_hardware"]
