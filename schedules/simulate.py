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
from autopar.schedules.deps import needs, produces
from autopar.schedules.ir import COMPUTE_TYPES, Action, B, F, I, Schedule, W


@dataclass(frozen=True)
class SimResult:
    makespan: float
    bubble_fraction: float  # 1 - sum(busy) / (pp * makespan)
    busy: tuple[float, ...]  # per rank: time spent computing
    peak_memory: tuple[float, ...]  # per rank, in ``memory_unit``
    memory_unit: str  # "M_B" or "bytes"
    timeline: tuple[tuple[int, Action, float, float], ...]  # (rank, action, start, end), by rank then order
    # per rank, (end, duration) of its last I/W/B; per stage, when its last W/B ended (0 if none);
    # per rank, when its last action ended
    last_backward: tuple[tuple[float, float], ...] = ()
    stage_done: tuple[float, ...] = ()
    ends: tuple[float, ...] = ()

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


_TYPE_CODE = {F: 0, I: 1, W: 2, B: 3}
_KIND_CODE = {"F": 0, "G": 1, "I": 2}


@dataclass(frozen=True)
class _Compiled:
    """A schedule's actions as integers, made once per schedule (``_compiled``): per rank, each
    action's code (type code * S + stage: also its index into the durations) and microbatch;
    per code, the keys it needs as (key base, boundary whose transfer delay is added, or -1 on
    the same rank) and the key bases it produces, from ``deps.needs`` / ``deps.produces`` (a
    key of microbatch k is its base + k: keys ``(stage, kind, k)`` are numbered
    ``(stage * 3 + kind) * M + k``)."""
    codes: tuple[tuple[int, ...], ...]
    mbs: tuple[tuple[int, ...], ...]
    needs: tuple[tuple[tuple[int, int], ...], ...]
    makes: tuple[tuple[int, ...], ...]
    keys: int


def _compiled(schedule: Schedule) -> _Compiled:
    hit = schedule.__dict__.get("_sim_compiled")
    if hit is not None:
        return hit
    S, owner = schedule.num_stages, schedule.stage_to_rank
    M = 1 + max((a.microbatch for acts in schedule.actions for a in acts), default=0)
    types = [F, I, W, B]
    need, make = [], []
    for t in types:
        for st in range(S):
            a = Action(st, t, 0)
            need.append(tuple(((n[0] * 3 + _KIND_CODE[n[1]]) * M, min(n[0], st) if owner[n[0]] != owner[st] else -1)
                              for n in needs(a, S)))
            make.append(tuple((k[0] * 3 + _KIND_CODE[k[1]]) * M for k in produces(a)))
    codes, mbs = [], []
    for acts in schedule.actions:
        bad = [a for a in acts if a.type not in COMPUTE_TYPES]
        if bad:
            raise ValueError(f"simulate takes compute actions only (F, I, W, B), got {bad[0]}; simulate before lower()")
        codes.append(tuple(_TYPE_CODE[a.type] * S + a.stage for a in acts))
        mbs.append(tuple(a.microbatch for a in acts))
    out = _Compiled(tuple(codes), tuple(mbs), tuple(need), tuple(make), S * 3 * M)
    object.__setattr__(schedule, "_sim_compiled", out)  # the schedule is frozen; this is a cache of it
    return out


def simulate(schedule: Schedule, costs=None, p2p_latency: float = 0.0, p2p_bandwidth: float | None = None,
             stage_bytes: Sequence[float] | None = None, *, message_bytes: Sequence[float] | None = None,
             i_free_fraction: float = 0.5, memory: bool = True, timeline: bool = True) -> SimResult:
    """Replay ``schedule`` with ``costs`` (per-rank (F, I, W[, B]), a ``Costs``, or None = unit).
    ``memory=False``: leave ``peak_memory`` empty (its walk is not needed by every caller);
    ``timeline=False``: leave ``timeline`` empty (``last_backward`` and ``stage_done`` hold
    what the planner reads of it).

    Event-driven: a rank runs its actions in order until one waits on a value not made yet; it
    is then parked on that value and resumed when the value is made, so no rank is polled while
    it waits. Raises ValueError if the order cannot complete (an action waits on one that never
    runs); ``validate()`` explains such schedules in more detail.
    """
    c: Costs = as_costs(costs, schedule.stage_to_rank)
    S, pp = schedule.num_stages, schedule.pp
    delay = comm_delays(S, p2p_latency, p2p_bandwidth, message_bytes)
    comp = _compiled(schedule)
    dur_of = list(c.f) + list(c.i) + list(c.w) + [c.backward(s) for s in range(S)]
    # An input from a stage on another rank arrives delay[b] after it was made, b the boundary
    # between the two (adjacent) stages; -1.0: not produced yet (times are >= 0)
    done = [-1.0] * comp.keys
    free = [0.0] * pp
    busy = [0.0] * pp
    pos = [0] * pp
    last_bwd = [(0.0, 0.0)] * pp
    stage_done = [0.0] * S
    ovl = [schedule.overlaps(r) for r in range(pp)]
    rows: list[list[tuple[int, Action, float, float]]] = [[] for _ in range(pp)]
    fb = c.fb_ratio
    need_of, make_of = comp.needs, comp.makes
    waiting: dict[int, list[int]] = {}  # key not made yet -> ranks parked on it
    todo = list(range(pp - 1, -1, -1))  # ranks that can run (a stack: rank 0 first)
    bwd_code, wb_code = S, 2 * S      # codes >= S are I/W/B, >= 2S are W/B

    def ready(code: int, k: int) -> float:
        """When the action's inputs have all arrived, or ``-1 - key`` of the first not made yet."""
        t = 0.0
        for base, bnd in need_of[code]:
            e = done[base + k]
            if e < 0.0:
                return -1.0 - (base + k)
            if bnd >= 0:
                e += delay[bnd]
            if e > t:
                t = e
        return t

    def make(code: int, k: int, end: float) -> None:
        for base in make_of[code]:
            key = base + k
            done[key] = end
            woken = waiting.pop(key, None)
            if woken:
                todo.extend(woken)

    while todo:
        r = todo.pop()
        acts = schedule.actions[r]
        n = len(acts)
        code_r, k_r, ovl_r, row = comp.codes[r], comp.mbs[r], ovl[r], rows[r]
        i, f_r, b_r = pos[r], free[r], busy[r]
        while i < n:
            code, k = code_r[i], k_r[i]
            t = ready(code, k)
            if ovl_r and i in ovl_r:  # an F&B unit: both halves start and end together
                code2, k2 = code_r[i + 1], k_r[i + 1]
                if t >= 0.0:  # the later arrival, or the second half's missing value
                    t2 = ready(code2, k2)
                    t = t2 if t2 < 0.0 else max(t, t2)
                if t < 0.0:  # parked on the value it waits for
                    waiting.setdefault(int(-1.0 - t), []).append(r)
                    break
                start = f_r if f_r > t else t
                dur = fb * (dur_of[code] + dur_of[code2])
                end = start + dur
                make(code, k, end)
                make(code2, k2, end)
                if timeline:
                    row.append((r, acts[i], start, end))
                    row.append((r, acts[i + 1], start, end))
                for c_ in (code, code2):
                    if c_ >= wb_code and end > stage_done[c_ % S]:
                        stage_done[c_ % S] = end
                code, step = max(code, code2), 2
            else:
                if t < 0.0:
                    waiting.setdefault(int(-1.0 - t), []).append(r)
                    break
                start = f_r if f_r > t else t
                dur = dur_of[code]
                end = start + dur
                make(code, k, end)
                if timeline:
                    row.append((r, acts[i], start, end))
                if code >= wb_code and end > stage_done[code % S]:
                    stage_done[code % S] = end
                step = 1
            if code >= bwd_code and end >= last_bwd[r][0]:
                last_bwd[r] = (end, end - start)
            f_r = end
            b_r += dur
            i += step
        pos[r], free[r], busy[r] = i, f_r, b_r
    if any(pos[r] < len(schedule.actions[r]) for r in range(pp)):
        stuck = ", ".join(f"rank {r} at {schedule.actions[r][pos[r]]}" for r in range(pp)
                          if pos[r] < len(schedule.actions[r]))
        raise ValueError(f"schedule {schedule.name} cannot complete: every rank waits ({stuck}); "
                         "run validate() for the broken dependency")
    makespan = max(free) if pp else 0.0
    bubble = 1.0 - sum(busy) / (pp * makespan) if makespan > 0 else 0.0
    unit = "bytes" if stage_bytes is not None else "M_B"
    return SimResult(makespan=makespan, bubble_fraction=bubble, busy=tuple(busy),
                     peak_memory=peak_memory(schedule, stage_bytes, i_free_fraction) if memory else (),
                     memory_unit=unit, timeline=tuple(x for row in rows for x in row),
                     last_backward=tuple(last_bwd), stage_done=tuple(stage_done), ends=tuple(free))
