"""One action of a (lowered) program -> the runtime primitive calls that carry it out.

An executor (``DistributedPipeline``, ``LocalPipeline``) offers the primitives ``recv_f`` /
``recv_b`` (post a receive), ``send_f`` / ``send_b``, ``wait_f`` / ``wait_b`` (take a received
value), ``forward(s, k)``, ``backward(s, k, kind)``, ``weight(s, k)`` and, for an F&B unit of
DualPipeV, ``forward_backward(sf, kf, sb, kb, kind)``. ``calls`` says which
ones an action means on a given rank: a compute action first waits for every input made on
another rank (the dependency rule, schedules/deps.py), then computes. ``interpret`` and
``run_action`` call them; ``runtime/codegen.py`` writes the same calls out as Python lines.
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

from autopar.schedules.deps import needs
from autopar.schedules.ir import RECV_B, RECV_F, SEND_B, SEND_F, Action, B, F, I, W


class Call(NamedTuple):
    """``rt.<primitive>(*args)``; ``note`` is the comment the generated code puts on that line."""

    primitive: str
    args: tuple
    note: str = ""


def calls(action: Action, stage_to_rank: Sequence[int], rank: int) -> tuple[Call, ...]:
    """The primitive calls that run ``action`` on pipeline rank ``rank``, in order."""
    s, k, t = action.stage, action.microbatch, action.type
    if t == RECV_F:
        return (Call("recv_f", (s, k), f"post receive: activations for {s}F{k}"),)
    if t == RECV_B:
        return (Call("recv_b", (s, k), f"post receive: gradients for {s}B{k}"),)
    if t == SEND_F:
        return (Call("send_f", (s, k), f"to rank {stage_to_rank[s + 1]}"),)
    if t == SEND_B:
        return (Call("send_b", (s, k), f"to rank {stage_to_rank[s - 1]}"),)
    if t == F:
        return _waits(action, stage_to_rank, rank) + (Call("forward", (s, k)),)
    if t in (I, B):
        return _waits(action, stage_to_rank, rank) + (Call("backward", (s, k, t)),)
    if t == W:
        return (Call("weight", (s, k)),)
    raise ValueError(f"autopar: unknown action {action}")


def _waits(action: Action, stage_to_rank: Sequence[int], rank: int) -> tuple[Call, ...]:
    """wait_f / wait_b for each input of ``action`` computed on another rank (activations of
    the previous stage, the input gradient of the next); same-rank inputs were handed over."""
    s, k = action.stage, action.microbatch
    return tuple(Call("wait_f" if kind == "F" else "wait_b", (s, k))
                 for src, kind, _k in needs(action, len(stage_to_rank)) if stage_to_rank[src] != rank)


def unit_calls(f: Action, b: Action, stage_to_rank: Sequence[int], rank: int) -> tuple[Call, ...]:
    """An F&B unit (DualPipeV, ``Lowered.overlap``): both halves' waits, then one
    ``forward_backward`` running the two programs interleaved (runtime/stage_work.py)."""
    return _waits(f, stage_to_rank, rank) + _waits(b, stage_to_rank, rank) + (
        Call("forward_backward", (f.stage, f.microbatch, b.stage, b.microbatch, b.type),
             f"{f.stage}F{f.microbatch} with {b.stage}{b.type}{b.microbatch}: each hides the other's all-to-alls"),)


def program_calls(actions: Sequence[Action], stage_to_rank: Sequence[int], rank: int, overlap=frozenset()):
    """Every call of rank ``rank``'s lowered program; ``overlap``: positions of F&B units' F
    (whose next action is their B or I), run as one unit."""
    i = 0
    while i < len(actions):
        if i in overlap:
            yield from unit_calls(actions[i], actions[i + 1], stage_to_rank, rank)
            i += 2
        else:
            yield from calls(actions[i], stage_to_rank, rank)
            i += 1


def run_action(rt, action: Action, stage_to_rank: Sequence[int], rank: int) -> None:
    """Carry out one action on executor ``rt``."""
    for c in calls(action, stage_to_rank, rank):
        getattr(rt, c.primitive)(*c.args)


def interpret(rt, actions: Sequence[Action], stage_to_rank: Sequence[int], rank: int, overlap=frozenset()) -> None:
    """The oracle for generated programs: walk rank ``rank``'s lowered actions in order."""
    for c in program_calls(actions, stage_to_rank, rank, overlap):
        getattr(rt, c.primitive)(*c.args)
