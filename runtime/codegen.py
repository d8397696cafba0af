"""Generate each rank's step as straight-line Python from its lowered action list.

One line per primitive call of `runtime.actions.calls`: one per communication action, one or
two (a receive's wait right before the compute that reads it) per compute action. The
generated function calls the same primitives as `runtime.actions.interpret` (the oracle), so
both give identical results; `pm.dump` writes the source next to the stage code so a user can
read what rank r does.
"""
from __future__ import annotations

from .actions import program_calls


def generate_source(actions, stage_to_rank, rank: int, name: str = "step", overlap=frozenset()) -> str:
    """Source of ``def <name>(rt)`` running ``actions`` (rank ``rank``'s lowered program;
    ``overlap``: positions of its F&B units, ``Lowered.overlap[rank]``)."""
    lines = [f"def {name}(rt):",
             f"    # pipeline rank {rank}: {sum(1 for a in actions if a.is_compute)} compute actions, "
             f"{sum(1 for a in actions if not a.is_compute)} communication actions"]
    for c in program_calls(actions, stage_to_rank, rank, overlap):
        line = f"    rt.{c.primitive}({', '.join(map(repr, c.args))})"
        lines.append(f"{line}  # {c.note}" if c.note else line)
    return "\n".join(lines) + "\n"


def compile_step(source: str, name: str = "step"):
    namespace: dict = {}
    exec(compile(source, f"<autopar generated {name}>", "exec"), namespace)  # noqa: S102 - our own generated code
    return namespace[name]
