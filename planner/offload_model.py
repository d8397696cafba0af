"""Activation offload (runtime/offload.py) as the planner prices it: per stage, the share of a
microbatch's saved activations parked on the host between F and I/W.

Module functions work on a schedule's action order: the device and host peaks under given
shares (``offload_peaks``, walking the actions; ``points_peaks``, from the cached points where
a peak can fall, ``offload_points``), each rank's device bytes as linear functions of its
stages' shares (``offload_terms``) and the least shares that fit a budget (``least_offload``).
``OffloadModel`` (a part of planner/estimate.py's ``Evaluator``) turns a plan into those
inputs: what each stage can park (``movable_bytes``: graph values, not a MoE dispatch's received
rows), what only W reads (``w_only_bytes``), the copy time (``offload_seconds``) and the report.
"""
from __future__ import annotations

import math
from dataclasses import replace
from functools import lru_cache

from autopar.schedules.costs import Costs
from autopar.schedules.ir import F as _F
from autopar.schedules.ir import I as _I
from autopar.schedules.ir import W as _W

from .inflight import _count_walk, _undominated, steady_m
from .layout import Layout, Partition


def offload_peaks(schedule, after_f, after_i, parked_f, parked_w) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-rank peaks of saved activations on the device and of what is parked on the host,
    under an activation offload (runtime/offload.py), walking each rank's actions: of a
    microbatch's ``after_f[s]`` bytes, ``parked_f[s]`` are on the host from the end of its F
    until its I or B brings them back; I brings back all but ``parked_w[s]`` (what only W
    reads), which W brings back. During an F the microbatch is whole on the device, and so is
    what each backward program reads while it runs. With nothing parked the device peaks are
    ``schedules.simulate.peak_memory``'s with ``after_i_bytes``."""
    device, host = [], []
    for acts in schedule.actions:
        mem = peak = away = away_peak = 0.0
        for a in acts:
            s = a.stage
            if a.type == _F:
                peak = max(peak, mem + after_f[s])
                mem += after_f[s] - parked_f[s]
                away += parked_f[s]
            elif a.type == _I:
                peak = max(peak, mem + parked_f[s] - parked_w[s])
                mem += (after_i[s] - parked_w[s]) - (after_f[s] - parked_f[s])
                away -= parked_f[s] - parked_w[s]
            elif a.type == _W:
                peak = max(peak, mem + parked_w[s])
                mem -= after_i[s] - parked_w[s]
                away -= parked_w[s]
            else:  # B
                peak = max(peak, mem + parked_f[s])
                mem -= after_f[s] - parked_f[s]
                away -= parked_f[s]
            peak, away_peak = max(peak, mem), max(away_peak, away)
        device.append(peak)
        host.append(away_peak)
    return tuple(device), tuple(host)


@lru_cache(maxsize=4096)
def offload_points(name: str, pp: int, m: int, v: int) -> tuple:
    """Per rank of a fixed-order schedule: (its stages, the distinct points where
    ``offload_peaks``'s walk takes a peak), each point ``(counts, type, j)``: the microbatches
    of each of its stages past F (not yet I/B) and past I (not yet W) as in
    ``inflight_frontier``, and the action about to run there (its type and the index of its
    stage; type None: between actions), without the ones another point of the same action
    dominates. Independent of the amounts, so cached; past the warm-up the points repeat, and
    steady schedules are walked at ``steady_m`` as for the frontier."""
    m_eff = steady_m(name, pp, m, v)
    if m_eff != m:
        return offload_points(name, pp, m_eff, v)
    out = []
    for stages, steps in _count_walk(name, pp, m, v):
        groups: dict = {}  # (action type, stage index) -> points
        for before, t, j, after in steps:
            groups.setdefault((t, j), set()).add((before, t, j))
            groups.setdefault((None, 0), set()).add((after, None, 0))
        # a point whose counts another point of the same action type and stage has at least
        # as many of never holds more (every count multiplies bytes >= 0 at any shares, as
        # what only W reads is within what a microbatch keeps after I): only the others count
        keep = [p for g in groups.values() for p in _undominated(g, counts=lambda p: p[0])]
        out.append((stages, tuple(sorted(keep, key=repr))))
    return tuple(out)


def offload_terms(stages, points, after_f, after_i, movable, w_only) -> list[tuple[float, dict[int, float]]]:
    """``offload_peaks``'s device bytes of one rank as linear functions of its stages' offload
    shares: at every point of ``offload_points`` (the rank's ``stages`` and ``points``),
    ``(c, {stage: coefficient})`` such that the bytes there are ``c + sum(coefficient *
    share)``. ``movable[s]``: of ``after_f[s]``, the bytes the offload can park (graph values:
    not a MoE dispatch's received rows, which its op holds); ``w_only[s]``: of those, what only
    W reads (within ``after_i[s]``). A microbatch past F keeps ``after_f - share * movable`` on
    the device, one past I ``after_i - share * w_only``; the action about to run adds its whole
    F output, or what it brings back. The rank's peak at shares ``f`` is the largest of them."""
    k = len(stages)
    af = [movable[s] for s in stages]
    cf = [after_f[s] for s in stages]
    ai = [after_i[s] for s in stages]
    pw = [min(w_only[s], movable[s]) for s in stages]
    out = []
    for counts, t, j in points:
        c = sum(counts[i] * cf[i] + counts[k + i] * ai[i] for i in range(k))
        coef = [-(counts[i] * af[i] + counts[k + i] * pw[i]) for i in range(k)]
        if t == _F:
            c += cf[j]
        elif t == _I:
            coef[j] += af[j] - pw[j]
        elif t == _W:
            coef[j] += pw[j]
        elif t is not None:  # B
            coef[j] += af[j]
        out.append((c, {s: x for s, x in zip(stages, coef) if x}))
    return out


def points_peaks(ranks, after_f, after_i, movable, w_only, shares) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """``offload_peaks`` of a fixed-order schedule from its ``offload_points`` (``ranks``)
    instead of a walk of every action: per rank, the device peak (the largest of
    ``offload_terms`` at ``shares``, one per stage) and the host peak (the most parked bytes
    at any point: microbatches past F park ``share * movable``, past I ``share * w_only``)."""
    device, host = [], []
    for stages, points in ranks:
        k = len(stages)
        f = [shares[s] for s in stages]
        away_f = [f[i] * movable[s] for i, s in enumerate(stages)]
        away_w = [f[i] * min(w_only[s], movable[s]) for i, s in enumerate(stages)]
        device.append(max((c + sum(x * shares[s] for s, x in coef.items())
                           for c, coef in offload_terms(stages, points, after_f, after_i, movable, w_only)),
                          default=0.0))
        host.append(max((sum(counts[i] * away_f[i] + counts[k + i] * away_w[i] for i in range(k))
                         for counts, _, _ in points), default=0.0))
    return tuple(device), tuple(host)


def least_offload(points, budget: float, stages, copied) -> dict[int, float] | None:
    """The smallest offload shares of one rank's ``stages`` that keep every point of
    ``offload_terms`` within ``budget`` bytes, or None if parking all of them is not enough.
    Stages are raised one at a time, the one whose full offload lowers the peak most per byte
    it copies (``copied[s]``: a microbatch's bytes at share 1) first, each to the least share
    that fits given the ones before (rounded up to 1/1000); ties by stage index."""
    def peak(f):
        return max(c + sum(k.get(s, 0.0) * x for s, x in f.items()) for c, k in points)

    if not points:
        return {s: 0.0 for s in stages}
    shares = {s: 0.0 for s in stages}
    base = peak(shares)
    if base <= budget:
        return shares
    gain = {s: (base - peak({**shares, s: 1.0})) / max(copied[s], 1.0) for s in stages}
    for s in sorted(stages, key=lambda t: (-gain[t], t)):
        lower = 0.0
        for c, k in points:
            rest = c + sum(k.get(t, 0.0) * x for t, x in shares.items() if t != s)
            if rest > budget:
                ks = k.get(s, 0.0)
                lower = max(lower, (rest - budget) / -ks if ks < 0 else math.inf)
        shares[s] = 1.0 if lower >= 1.0 else math.ceil(lower * 1000 - 1e-9) / 1000
        if peak(shares) <= budget * (1 + 1e-12):
            return shares
    return None


class OffloadModel:
    """The activation-offload terms of ``Evaluator`` (planner/estimate.py), which mixes this in."""

    def offload_peaks(self, sched, lay: Layout, part: Partition, after_f, after_i) -> tuple[tuple, tuple]:
        """Per rank under ``lay.offload``, the device and host peaks of saved activations
        (``offload_peaks``): a fixed order's from its cached ``offload_points``, zb-auto's
        from a walk of ``sched``."""
        if lay.schedule != "zb-auto":
            movable = self.movable_bytes(lay, part)
            return points_peaks(offload_points(lay.schedule, lay.pp, lay.m, lay.v), after_f, after_i, movable,
                                self.w_only_bytes(lay, part, movable, after_i),
                                [lay.offload_of(s) for s in range(len(after_f))])
        return offload_peaks(sched, after_f, after_i, *self.parked(lay, part, after_i))

    def parked(self, lay: Layout, part: Partition, after_i) -> tuple[list[float], list[float]]:
        """Per stage under ``lay.offload``: the bytes of a microbatch parked on the host after
        its F (its share of ``movable_bytes``), and of those what stays parked through I (what
        only W reads; at stage 0, whose I is empty, all of it). ``after_i``: ``stage_amounts``'s."""
        movable = self.movable_bytes(lay, part)
        w_only = self.w_only_bytes(lay, part, movable, after_i)
        return ([lay.offload_of(s) * a for s, a in enumerate(movable)],
                [lay.offload_of(s) * w for s, w in enumerate(w_only)])

    def movable_bytes(self, lay: Layout, part: Partition) -> tuple[float, ...]:
        """Per stage, the bytes of a microbatch's saved activations the offload can park: the
        graph's saved values and kept inputs (runtime/offload.py), not the rows a MoE dispatch
        received (its op keeps them: ``stage_amounts`` without them)."""
        return self.stage_amounts(lay, part, moe=False)[0]

    def w_only_bytes(self, lay: Layout, part: Partition, movable, after_i) -> list[float]:
        """Per stage, of a microbatch's movable bytes, what only W reads (at stage 0, whose I is
        empty, all of it), within what it keeps after I (``stage_amounts``)."""
        sc = self.scale(lay)
        return [min(movable[0] if s == 0 else sum(k.saved_w_only for k in kinds) * sc, movable[s], after_i[s])
                for s, kinds in enumerate(self.stage_kinds(part))]

    def least_offload(self, lay: Layout, part: Partition) -> tuple[float, ...] | None:
        """Per stage, the smallest share of its saved activations to park on the host for every
        rank of ``lay`` (a fixed-order schedule) at ``part`` to fit the memory limit, or None if
        no shares do (or the order is searched, zb-auto). A rank's budget for saved activations
        is the limit less everything else it holds (``memory``'s rows without the activations
        and the reduction buffers that reuse their memory); each rank's shares come from the walk
        of its actions (``offload_terms``, ``least_offload``): its stages whose microbatches wait
        longest between F and I/W first, the others not at all where those suffice. Each copy
        then costs what F and I do not hide (``stage_costs``), so the least shares are the
        cheapest that fit."""
        from autopar.schedules.registry import layout as stage_layout

        if lay.schedule == "zb-auto":
            return None
        plain = replace(lay, offload=0.0)
        S = lay.num_stages
        s2r = stage_layout(lay.schedule, lay.pp, lay.v) if lay.pp > 1 else (0,) * S
        rows, totals = self.memory(plain, part, s2r, self.activation_peaks(None, plain, part), split_moe=False)
        after_f, after_i = self.stage_amounts(lay, part)
        movable = self.movable_bytes(lay, part)
        w_only = self.w_only_bytes(lay, part, movable, after_i)
        shares = [0.0] * S
        for row, total, (stages, points) in zip(rows, totals, offload_points(lay.schedule, lay.pp, lay.m, lay.v)):
            act = row["activations"] + row["moe receive"]
            budget = self.memory_limit - (total - act - row["dp buckets"] - row["zero-1 buffers"])
            got = least_offload(offload_terms(stages, points, after_f, after_i, movable, w_only), budget, stages,
                                movable)
            if got is None:
                return None
            for s, f in got.items():
                shares[s] = f
        return tuple(shares)

    def offload_report(self, lay: Layout, part: Partition, sched, costs: Costs) -> tuple[tuple, tuple]:
        """Per pp rank under ``lay.offload``: the peak of the bytes parked on the host
        (``offload_peaks``) and the copy time its F and I/B do not hide over the step (each of
        its stages runs m of each)."""
        after_f, after_i = self.stage_amounts(lay, part)
        host = self.offload_peaks(sched, lay, part, after_f, after_i)[1]
        plain = self.stage_costs(replace(lay, offload=0.0), part)
        s2r = sched.stage_to_rank
        exposed = tuple(lay.m * sum(costs.f[s] - plain.f[s] + costs.i[s] - plain.i[s]
                                    for s in range(len(s2r)) if s2r[s] == r) for r in range(lay.pp))
        return host, exposed

    def offload_seconds(self, lay: Layout, nbytes: float) -> float:
        """Seconds one copy of ``nbytes`` between device and host takes: over the host link on a
        GPU (a side stream), a read and a write at the streaming bandwidth on the cpu profile
        (the same memory, synchronous)."""
        if self.device.name == "cpu":
            return 2 * nbytes / self.stream_bandwidth(lay)
        return nbytes / self.device.host_bandwidth
