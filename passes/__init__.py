"""Graph passes: capture -> split_stages -> split_backward (-> exec_code, for the runtime), and
the rewrites a parallelism needs (context_parallel, expert_parallel, zero_stream). Each takes
and returns plain data; keys.py is the vocabulary programs name their values with."""
from .capture import CapturedGraph, capture
from .program import Program, StageInfo, StageProgram
from .split_backward import split_backward, stage_programs
from .split_stages import StageGraph, split_stages

__all__ = ["CapturedGraph", "capture", "StageGraph", "split_stages", "Program", "StageInfo", "StageProgram",
           "split_backward", "stage_programs"]
