"""Graph passes: capture -> split_stages -> split_backward. Each takes and returns plain data."""
from .capture import CapturedGraph, capture
from .split_stages import StageGraph, split_stages
from .split_backward import StageProgram, split_backward

__all__ = ["CapturedGraph", "capture", "StageGraph", "split_stages", "StageProgram", "split_backward"]
