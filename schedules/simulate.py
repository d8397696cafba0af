"""Event-driven replay of a schedule: makespan, bubble, busy time, peak memory, timeline.

Timing model (all times in the caller's unit, e.g. ms):

* every rank runs its actions in order, one at a time; an action starts when the rank is
  free and its inputs exist (the rule of ``deps.py``): F(s,k) after F(s-1,k); I/B(s,k) after
  F(s,k) and after I/B(s+1,k); W(s,k) after I(s,k);
* an input produced on another rank arrives ``p2p_latency + message_bytes[b] / p2p_bandwidth``
  after it was produced (b = the boundary between stages b and b+1; both directions carry a
  tensor of that size). Inputs produced on the same rank cost nothing;
* an F&B overlap unit (``schedule.overlap``, DualPipeV) starts when both halves' inputs exist
  and both halves finish together after ``fb_ratio * (F + B)``.

Memory model, per rank, in M_B (one microbatch through the rank's share of the model) or in
bytes when ``stage_bytes`` gives each stage's saved-activation size:

* F of stage s keeps ``act[s]`` alive (``1/v`` M_B for a rank with v stages);
* I frees the fraction ``i_free_fraction`` of it (default 0.5: what only the input
  gradient needed), W frees the rest, B frees all of it.

Memory changes only at a rank's own action boundaries, so the peak depends on the order and
not on the timing; frees at an instant are applied before allocations.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from autopar.schedules.costs import Costs, activation_units, as_costs
from autopar.schedules.deps import Key, needs, produces
from autopar.schedules.ir import COMPUTE_TYPES, Action, B, F, I, Schedule, W


@dataclass(frozen=True)
class SimResult:
    makespan: float
    bubble_fraction: float  # 1 - sum(busy) / (pp * makespan)
    busy: tuple[float, ...]  # per rank: time spent computing
    peak_memory: tuple[float, ...]  # per rank, in ``memory_unit``
    memory_unit: str  # "M_B" or "bytes"
    timeline: tuple[tuple[int, Action, float, float], ...]  # (rank, action, start, end), by rank then order

    @property
    def idle(self) -> tuple[float, ...]:
        return tuple(self.makespan - b for b in self.busy)


def peak_memory(schedule: Schedule, stage_bytes: Sequence[float] | None = None,
                i_free_fraction: float = 0.5, after_i_bytes: Sequence[float] | None = None) -> tuple[float, ...]:
    """Per-rank peak activation memory of ``schedule`` (see the module docstring).

    ``after_i_bytes`` (with ``stage_bytes``): what each stage's microbatch holds between its I
    and its W, in place of ``(1 - i_free_fraction) * stage_bytes``; it may exceed the F amount
    (I computes values that W reads), so I can raise the memory too.
    """
    if not 0.0 <= i_free_fraction <= 1.0:
        raise ValueError(f"i_free_fraction must be in [0, 1], got {i_free_fraction}")
    act = activation_units(schedule.stage_to_rank, stage_bytes)
    if after_i_bytes is None:
        after_i = tuple(a * (1.0 - i_free_fraction) for a in act)
    else:
        if stage_bytes is None or len(after_i_bytes) != len(act):
            raise ValueError(f"after_i_bytes needs stage_bytes and one entry per stage ({len(act)})")
        after_i = tuple(float(x) for x in after_i_bytes)
    delta = {F: act, I: tuple(b - a for a, b in zip(act, after_i)), W: tuple(-b for b in after_i),
             B: tuple(-a for a in act)}
    peaks = []
    for acts in schedule.actions:
        mem = peak = 0.0
        # An F&B overlap unit is (F, B) in program order: the F's memory is live before the B
        # half releases its own, so walking the order gives the unit's peak too.
        for a in acts:
            mem += delta[a.type][a.stage]
            peak = max(peak, mem)
        peaks.append(peak)
    return tuple(peaks)


def comm_delays(num_stages: int, p2p_latency: float, p2p_bandwidth: float | None,
                message_bytes: Sequence[float] | None) -> tuple[float, ...]:
    """Transfer time across boundary b (stage b -> b+1 forward, b+1 -> b backward)."""
    if p2p_latency < 0:
        raise ValueError(f"p2p_latency must be >= 0, got {p2p_latency}")
    delays = [float(p2p_latency)] * max(num_stages - 1, 0)
    if p2p_bandwidth is not None:
        if p2p_bandwidth <= 0:
            raise ValueError(f"p2p_bandwidth must be > 0, got {p2p_bandwidth}")
        if message_bytes is None:
            raise ValueError("p2p_bandwidth needs message_bytes (size of the tensor crossing each stage boundary, "
                             f"{num_stages - 1} entries)")
        if len(message_bytes) not in (num_stages - 1, num_stages):
            raise ValueError(f"message_bytes: {len(message_bytes)} entries, expected {num_stages - 1} "
                             "(one per stage boundary)")
        delays = [d + float(message_bytes[b]) / p2p_bandwidth for b, d in enumerate(delays)]
    return tuple(delays)


def simulate(schedule: Schedule, costs=None, p2p_latency: float = 0.0, p2p_bandwidth: float | None = None,
             stage_bytes: Sequence[float] | None = None, *, message_bytes: Sequence[float] | None = None,
             i_free_fraction: float = 0.5) -> SimResult:
    """Replay ``schedule`` with ``costs`` (per-rank (F, I, W[, B]), a ``Costs``, or None = unit).

    Raises ValueError if the order cannot complete (an action waits on one that never runs);
    ``validate()`` explains such schedules in more detail.
    """
    c: Costs = as_costs(costs, schedule.stage_to_rank)
    S, pp = schedule.num_stages, schedule.pp
    delay = comm_delays(S, p2p_latency, p2p_bandwidth, message_bytes)
    owner = schedule.stage_to_rank
    done: dict[Key, float] = {}  # deps key -> time the value exists on its producer's rank

    def ready(a: Action) -> float | None:
        """Earliest time ``a``'s inputs exist on its rank, or None if some input is not produced yet.

        An input from a stage on another rank arrives ``delay[b]`` after it was made, b the
        boundary between the two (adjacent) stages.
        """
        if a.type not in COMPUTE_TYPES:
            raise ValueError(f"simulate takes compute actions only (F, I, W, B), got {a}; simulate before lower()")
        t = 0.0
        for need in needs(a, S):
            e = done.get(need)
            if e is None:
                return None
            src = need[0]
            t = max(t, e + (delay[min(src, a.stage)] if owner[src] != owner[a.stage] else 0.0))
        return t

    def finish(a: Action, end: float) -> None:
        done.update(dict.fromkeys(produces(a), end))

    free = [0.0] * pp
    busy = [0.0] * pp
    pos = [0] * pp
    ovl = [schedule.overlaps(r) for r in range(pp)]
    rows: list[list[tuple[int, Action, float, float]]] = [[] for _ in range(pp)]
    remaining = sum(len(a) for a in schedule.actions)
    while remaining:
        progressed = False
        for r in range(pp):
            acts = schedule.actions[r]
            while pos[r] < len(acts):
                a = acts[pos[r]]
                if pos[r] in ovl[r]:
                    b = acts[pos[r] + 1]
                    ta, tb = ready(a), ready(b)
                    if ta is None or tb is None:
                        break
                    start = max(free[r], ta, tb)
                    dur = c.fb_ratio * (c.of(a.type, a.stage) + c.of(b.type, b.stage))
                    end = start + dur
                    finish(a, end)
                    finish(b, end)
                    rows[r].append((r, a, start, end))
                    rows[r].append((r, b, start, end))
                    step = 2
                else:
                    t = ready(a)
                    if t is None:
                        break
                    start = max(free[r], t)
                    dur = c.of(a.type, a.stage)
                    end = start + dur
                    finish(a, end)
                    rows[r].append((r, a, start, end))
                    step = 1
                free[r] = end
                busy[r] += dur
                pos[r] += step
                remaining -= step
                progressed = True
        if not progressed:
            stuck = ", ".join(f"rank {r} at {schedule.actions[r][pos[r]]}" for r in range(pp)
                              if pos[r] < len(schedule.actions[r]))
            raise ValueError(f"schedule {schedule.name} cannot complete: every rank waits ({stuck}); "
                             "run validate() for the broken dependency")
    makespan = max(free) if pp else 0.0
    bubble = 1.0 - sum(busy) / (pp * makespan) if makespan > 0 else 0.0
    unit = "bytes" if stage_bytes is not None else "M_B"
    return SimResult(makespan=makespan, bubble_fraction=bubble, busy=tuple(busy),
                     peak_memory=peak_memory(schedule, stage_bytes, i_free_fraction), memory_unit=unit,
                     timeline=tuple(x for row in rows for x in row))
