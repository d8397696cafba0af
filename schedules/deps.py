"""The pipeline dependency rule, stated once.

    F(s-1,k) -> F(s,k)        activations of the previous stage
    F(s,k)   -> I/B(s,k)      a backward needs its own forward
    I/B(s+1,k) -> I/B(s,k)    the input gradient of the next stage
    I(s,k)   -> W(s,k)        the weight gradient runs after its input gradient

Values are named by keys ``(stage, kind, microbatch)``: kind "F" = the forward activations of
that stage, "G" = its input gradient (made by I or B), "I" = its I ran (what W waits for).
``needs`` and ``produces`` speak in these keys; the validator, the simulator, the deadlock
check of the lowered programs and local mode all replay a schedule with them, each adding its
own notion of where a value lives (same rank or received) and when it arrives.
"""
from __future__ import annotations

from autopar.schedules.ir import COMPUTE_TYPES, Action, B, F, I, W

Key = tuple[int, str, int]  # (stage, kind, microbatch), kind in "F", "G", "I"

_PRODUCES: dict[str, tuple[str, ...]] = {F: ("F",), I: ("G", "I"), B: ("G",), W: ()}


def needs(action: Action, num_stages: int) -> tuple[Key, ...]:
    """The keys that must exist before compute ``action`` runs, in the order callers report them.

    A stage-0 F reads only data and the last stage's I/B only the loss, so they need less.
    """
    s, t, k = action.stage, action.type, action.microbatch
    if t == F:
        return ((s - 1, "F", k),) if s > 0 else ()
    if t in (I, B):
        return ((s, "F", k),) + (((s + 1, "G", k),) if s + 1 < num_stages else ())
    if t == W:
        return ((s, "I", k),)
    raise ValueError(f"{action} is a communication action; dependencies are between compute actions (F, I, W, B)")


def produces(action: Action) -> tuple[Key, ...]:
    """The keys compute ``action`` makes exist (a W makes none: nothing waits for it)."""
    kinds = _PRODUCES.get(action.type)
    if kinds is None:
        raise ValueError(f"{action} is a communication action; only compute actions (F, I, W, B) produce values")
    return tuple((action.stage, kind, action.microbatch) for kind in kinds)


def producers(key: Key) -> tuple[Action, ...]:
    """The compute actions that can make ``key`` exist (kind "G": the I or the B of its stage)."""
    s, _kind, k = key
    return tuple(a for a in (Action(s, t, k) for t in COMPUTE_TYPES) if key in produces(a))
