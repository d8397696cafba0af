"""When a rank may let go of a tensor it sent: the earliest point at which the send is known
to be complete, read off the lowered programs of both ends.

gloo gives no way to ask whether a send finished: ``Work.is_completed()`` stays False until
``wait()`` is called, and a ``wait`` with a short timeout closes the pair. A ``wait`` on a send
whose receiver has not posted its receive blocks (a large message needs the receiver's
buffer), and blocking there can deadlock two ranks that wait on each other's sends. So the
runtime waits on a send only when the schedule proves that the receiver already has it:

    rank A sends X to rank B; B takes X (its ``wait_f``/``wait_b``, just before the compute
    that reads X); later in B's program B sends Y to A; A takes Y.
    Once A has taken Y, B had taken X, so X's send is complete: A waits on it (returns at
    once) and drops the tensor.

For each send, the release point is the first message A takes from B that B sent after
taking X. Under 1F1B the activations sent for microbatch k are released when the gradient of
k comes back, and a gradient sent back is released when the next activation arrives: what a
rank holds is bounded by its microbatches in flight, never by the step's microbatch count.
A send with no such later message (the step's last ones) is waited on at the end of the step.

Keys are those of the executor's primitives: ``("F", s, k)`` is ``send_f(s, k)`` (stage s's
activations of microbatch k, to stage s+1) or ``wait_f(s, k)`` (stage s's input activations),
``("B", s, k)`` is ``send_b(s, k)`` (stage s's input gradient, to stage s-1) or
``wait_b(s, k)`` (the gradient of stage s's outputs).
"""
from __future__ import annotations

from bisect import bisect_right
from typing import Sequence

from autopar.schedules.deps import needs
from autopar.schedules.ir import SEND_B, SEND_F, Action

Key = tuple[str, int, int]


def _received_as(kind: str, s: int, k: int) -> Key:
    """The receiver's wait key of the send ``(kind, s, k)``."""
    return ("F", s + 1, k) if kind == "F" else ("B", s - 1, k)


def _taken(actions: Sequence[Action], stage_to_rank: Sequence[int], rank: int) -> dict[Key, int]:
    """wait key -> position of the compute action that takes it (waits on it) on ``rank``."""
    n = len(stage_to_rank)
    out: dict[Key, int] = {}
    for i, a in enumerate(actions):
        if not a.is_compute:
            continue
        for src, kind, k in needs(a, n):
            if stage_to_rank[src] != rank:
                key = ("F", a.stage, k) if kind == "F" else ("B", a.stage, k)
                out.setdefault(key, i)
    return out


def _sent(actions: Sequence[Action], stage_to_rank: Sequence[int]) -> list[tuple[int, Key, int]]:
    """(position, send key, receiving rank) of every send in one rank's program."""
    out = []
    for i, a in enumerate(actions):
        if a.type == SEND_F:
            out.append((i, ("F", a.stage, a.microbatch), stage_to_rank[a.stage + 1]))
        elif a.type == SEND_B:
            out.append((i, ("B", a.stage, a.microbatch), stage_to_rank[a.stage - 1]))
    return out


def release_points(all_actions: Sequence[Sequence[Action]], stage_to_rank: Sequence[int],
                   rank: int) -> dict[Key, tuple[Key, ...]]:
    """wait key on ``rank`` -> the sends of ``rank`` that are complete once it was taken.

    ``all_actions``: every pipeline rank's lowered program (``Lowered.actions``). Units run
    interleaved (DualPipeV's F&B) take both halves' inputs before the unit, never later than
    the positions used here, so the points stay safe."""
    taken = [_taken(acts, stage_to_rank, r) for r, acts in enumerate(all_actions)]
    sent = [_sent(acts, stage_to_rank) for acts in all_actions]
    # one cross-rank input per compute action: a position names the key taken there
    at_position = {pos: key for key, pos in taken[rank].items()}
    out: dict[Key, list[Key]] = {}
    for peer in sorted({to for _i, _key, to in sent[rank]}):
        # the peer's sends to this rank, in its program order, with where this rank takes each
        back = [(i, taken[rank][_received_as(*key)]) for i, key, to in sent[peer] if to == rank]
        # earliest[j]: the first position at which this rank takes any of back[j:]
        earliest, best = [0] * len(back), None
        for j in range(len(back) - 1, -1, -1):
            best = back[j][1] if best is None else min(best, back[j][1])
            earliest[j] = best
        back_positions = [i for i, _t in back]
        for _i, key, to in sent[rank]:
            if to != peer:
                continue
            j = bisect_right(back_positions, taken[peer][_received_as(*key)])
            if j < len(back):
                out.setdefault(at_position[earliest[j]], []).append(key)
    return {k: tuple(v) for k, v in out.items()}
