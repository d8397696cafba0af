"""The fixed one-forward-one-backward family: gpipe, 1f1b, interleaved-1f1b, zb-h1.

All four are one rank program each, written down directly (no search). Stage s lives on
rank s % pp (Megatron interleaving; with v = 1 that is stage r on rank r).
"""
from __future__ import annotations

from collections import deque

from autopar.schedules.ir import Action, B, F, I, Schedule, W, linear_layout, make_schedule


def gpipe(pp: int, m: int) -> Schedule:
    """All forwards, then all backwards, per rank. The numerics oracle: peak m * M_B."""
    acts = []
    for r in range(pp):
        acts.append([Action(r, F, k) for k in range(m)] + [Action(r, B, k) for k in range(m)])
    return make_schedule("gpipe", pp, linear_layout(pp, 1), m, acts)


def _virtual(k: int, pp: int, v: int, rank: int, backward: bool) -> tuple[int, int]:
    """(stage, microbatch) of the k-th forward (or backward) of ``rank`` in Megatron order.

    Microbatches go through a rank's chunks in groups of pp: chunk 0 for microbatches
    0..pp-1, then chunk 1 for the same group, ... ; backwards visit chunks in reverse.
    """
    chunk = (k // pp) % v
    if backward:
        chunk = v - 1 - chunk
    mb = (k // (pp * v)) * pp + k % pp
    return chunk * pp + rank, mb


def one_f_one_b_rank(pp: int, v: int, m: int, rank: int, warmup: int, split: bool, w_lag: int) -> list[Action]:
    """One rank of (interleaved) 1F1B: ``warmup`` forwards, then F/backward pairs, then backwards.

    With ``split`` each backward is an I, and the W of the i-th backward is emitted once
    ``w_lag`` more backwards have run (ZB-H1 defers rank r's W by r to fill its cooldown
    bubble); the remaining W close the program.
    """
    total = m * v
    warmup = min(warmup, total)
    out: list[Action] = []
    pending_w: deque[Action] = deque()
    n_bwd = 0

    def backward(j: int) -> None:
        nonlocal n_bwd
        s, k = _virtual(j, pp, v, rank, backward=True)
        if split:
            out.append(Action(s, I, k))
            pending_w.append(Action(s, W, k))
            n_bwd += 1
            if n_bwd > w_lag:
                out.append(pending_w.popleft())
        else:
            out.append(Action(s, B, k))

    for k in range(warmup):
        s, mb = _virtual(k, pp, v, rank, backward=False)
        out.append(Action(s, F, mb))
    for i in range(total - warmup):
        s, mb = _virtual(warmup + i, pp, v, rank, backward=False)
        out.append(Action(s, F, mb))
        backward(i)
    for j in range(total - warmup, total):
        backward(j)
    out.extend(pending_w)
    return out


def one_f_one_b(pp: int, m: int) -> Schedule:
    """Non-interleaved 1F1B: rank r warms up with pp-1-r forwards; peak pp * M_B."""
    acts = [one_f_one_b_rank(pp, 1, m, r, pp - 1 - r, split=False, w_lag=0) for r in range(pp)]
    return make_schedule("1f1b", pp, linear_layout(pp, 1), m, acts)


def interleaved_1f1b(pp: int, m: int, v: int) -> Schedule:
    """Megatron-LM interleaved 1F1B (SC'21) with v stages per rank, stage s on rank s % pp.

    Warm-up of rank r: 2*(pp-1-r) + (v-1)*pp virtual forwards (all of them when m == pp).
    """
    acts = []
    for r in range(pp):
        warmup = m * v if m == pp else 2 * (pp - 1 - r) + (v - 1) * pp
        acts.append(one_f_one_b_rank(pp, v, m, r, warmup, split=False, w_lag=0))
    return make_schedule("interleaved-1f1b", pp, linear_layout(pp, v), m, acts)


def zb_h1(pp: int, m: int, v: int) -> Schedule:
    """ZB-H1 (Zero Bubble PP, arXiv 2401.10241 §2.2): 1F1B's warm-up with B split into I and W.

    Rank r defers its W by r backwards; those W fill the cooldown bubble, leaving
    (pp-1)(F+I-W) instead of (pp-1)(F+I+W) at the same pp * M_B peak. With v > 1 the same
    rule on the interleaved layout (warm-up (v-1)*pp + pp-1-r) is torch's
    ScheduleInterleavedZeroBubble (ZB1P).
    """
    acts = []
    for r in range(pp):
        warmup = (v - 1) * pp + (pp - 1 - r)
        acts.append(one_f_one_b_rank(pp, v, m, r, warmup, split=True, w_lag=r))
    return make_schedule("zb-h1", pp, linear_layout(pp, v), m, acts)
