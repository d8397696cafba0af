"""Memory-capped and searched schedules: zb-h2, v-half, v-min, zb-auto.

* v-min is the repeated building block of "Pipeline Parallelism with Controllable Memory"
  (arXiv 2405.15362) with the smallest turn-around: microbatch k starts every F+I+W, each pass
  starts right after its input is ready, and the W go to the next free slot. The lifespans
  of a rank's two chunks add up to the same length on every rank, which is why its memory is
  balanced at about p/3 M_B.
* v-half and zb-h2 are the greedy list scheduler (greedy.py) at F=I=W under their memory
  bound; the knobs are searched once per (p, m) at unit cost and cached, so the order does not
  depend on real costs.
* zb-auto is the Zero Bubble paper's automatic scheduler heuristic (arXiv 2401.10241 §3.1,
  without the ILP refinement) on the real F/I/W and P2P times: it tries warm-up depths,
  forward/backward priorities and W placements, simulates every candidate, and keeps the
  fastest whose peak memory fits the limit. With two stages per rank it searches both the V
  and the interleaved layout. The fixed schedules that fit the limit (1F1B with as much
  warm-up as the memory allows, ZB-H1, ZB-H2; ZB-V, V-Half, V-Min, interleaved ZB-H1 and
  interleaved 1F1B) are candidates too, so zb-auto is never slower than any of them under the
  same limit.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence

from autopar.schedules.costs import Costs, activation_units, as_costs
from autopar.schedules.gen_1f1b import interleaved_1f1b, one_f_one_b_rank, zb_h1
from autopar.schedules.gen_v import zbv
from autopar.schedules.greedy import PREFER, Knobs, greedy_order
from autopar.schedules.ir import Action, B, F, I, Schedule, W, linear_layout, make_schedule, v_layout
from autopar.schedules.simulate import comm_delays, peak_memory, simulate

EPS = 1e-9


def v_min(pp: int, m: int) -> Schedule:
    """V-Min: peak floor((p+4)/3) M_B, bubble about 2/3 of 1F1B's at F=I=W.

    Time is counted in slots of F/2 (one stage pass at unit per-rank cost); a period of six
    slots holds F0, F1, I0, I1 and two W per rank. Pass of stage s of microbatch k:
    F at 6k + s, I at 6k + 2p + d + (2p-1-s). With d = 0 the four passes of a rank fall on
    distinct slots mod 6 unless 3 divides p; then d = 2 (one unit of wait at the turn)
    separates them. W(s,k) takes the first free slot after I(s,k).
    """
    S = 2 * pp
    delay = 2 if pp % 3 == 0 else 0
    owner = v_layout(pp)
    slots: list[dict[int, Action]] = [{} for _ in range(pp)]
    for k in range(m):
        for s in range(S):
            for t, a in ((6 * k + s, Action(s, F, k)), (6 * k + 2 * pp + delay + (S - 1 - s), Action(s, I, k))):
                taken = slots[owner[s]]
                assert t not in taken, (pp, s, t, a, taken[t])
                taken[t] = a
    acts = []
    for r in range(pp):
        taken = slots[r]
        for t in sorted(t for t, a in taken.items() if a.type == I):
            a = taken[t]
            u = t + 1
            while u in taken:
                u += 1
            taken[u] = Action(a.stage, W, a.microbatch)
        acts.append([taken[t] for t in sorted(taken)])
    return make_schedule("v-min", pp, owner, m, acts)


def _unit_greedy(name: str, layout: tuple[int, ...], m: int, limit: float, grid: Sequence[Knobs]) -> Schedule:
    """The best greedy order at F=I=W (per rank 1, 1, 1), zero latency, under ``limit`` M_B."""
    pp = max(layout) + 1
    costs = as_costs(None, layout)
    act = activation_units(layout)
    best = None
    for knobs in grid:
        res = greedy_order(layout, m, costs, [0.0] * (len(layout) - 1), act, [limit] * pp, knobs)
        if res is not None and (best is None or res.makespan < best.makespan - EPS):
            best = res
    assert best is not None, f"{name}: no greedy setting finished for pp={pp}, m={m}"
    return make_schedule(name, pp, layout, m, best.order)


@lru_cache(maxsize=256)
def v_half(pp: int, m: int) -> Schedule:
    """V-Half: peak floor((p+2)/2) M_B, bubble about half of 1F1B's at F=I=W.

    The greedy scheduler on the V layout under that memory bound; the in-flight cap K (how many
    microbatches a rank admits before the first returns) is searched over [L, 2L] at unit cost.
    """
    limit = (pp + 2) // 2
    ks = sorted({limit, limit + 1, round(1.25 * limit), round(1.5 * limit), 2 * limit})
    grid = [Knobs(prefer=p, w_policy="fit", inflight_max=k) for k in ks for p in ("I", "F")]
    return _unit_greedy("v-half", v_layout(pp), m, limit, grid)


@lru_cache(maxsize=256)
def zb_h2(pp: int, m: int) -> Schedule:
    """ZB-H2: warm-up of 2(p-r)-1 forwards on rank r and W filling every gap; peak (2p-1) M_B.

    At F=I=W it meets the single-step lower bound m(F+I+W) + (p-1)F (the last rank cannot start
    earlier); the (p-1)F is what the paper removes across steps by overlapping the optimizer.
    """
    grid = [Knobs(prefer="I", w_policy=w, inflight_slope=1.0) for w in ("fit", "eager")]
    return _unit_greedy("zb-h2", linear_layout(pp, 1), m, 2 * pp - 1, grid)


def _split(schedule: Schedule) -> list[list[Action]]:
    """Every B becomes I then W in place (same timing, earlier input gradient)."""
    out = []
    for acts in schedule.actions:
        row = []
        for a in acts:
            if a.type == B:
                row += [Action(a.stage, I, a.microbatch), Action(a.stage, W, a.microbatch)]
            else:
                row.append(a)
        out.append(row)
    return out


@dataclass(frozen=True)
class Candidate:
    label: str
    makespan: float
    peak: tuple[float, ...]
    fits: bool
    schedule: Schedule


def auto_grid(v: int) -> list[Knobs]:
    """The heuristic's search space: warm-up depth x priority x W placement.

    Pruned by experiment (240 random costs / limits / p <= 10): with one stage per rank "old"
    and "deep" order exactly like "I"; "strict", "lazy" and "immediate" W placement were the
    sole winner at most once.
    """
    policies = ("fit", "eager")
    if v == 1:
        return [Knobs(prefer=p, w_policy=w, inflight_slope=sl)
                for sl in (None, 0.0, 0.5, 1.0) for p in ("I", "F") for w in policies]
    return [Knobs(prefer=p, w_policy=w) for p in ("I", "F", "old", "deep") for w in policies]


def search_zb_auto(pp: int, m: int, v: int = 1, costs=None, memory_limit: float | None = None,
                   p2p_latency: float = 0.0, stage_bytes: Sequence[float] | None = None,
                   i_free_fraction: float = 0.5, effort: int = 0,
                   planner: bool = False) -> tuple[Schedule, list[Candidate]]:
    """zb-auto's search: returns (best schedule, every candidate tried, best first).

    ``planner``: the same best makespan for less work, as the planner prices thousands of
    layouts: a greedy run is abandoned once it cannot finish before the fastest fitting order
    found so far (the fixed schedules are built first for that), and the search stops at the
    first order that fits and reaches :func:`makespan_bound` (none is faster). The best is as
    fast as the whole search's, to rounding (where orders tie it may be another of them); the
    candidate list leaves out the abandoned and unsearched orders. ``autopar schedule`` shows
    every candidate.

    v = 1: one stage per rank. v = 2: two stages per rank, in a V or interleaved (stage s on
    rank s % pp), whichever simulates faster; ``stage_to_rank`` of the result says which.
    ``effort`` adds that many randomized greedy restarts per layout (deterministic seeds);
    0 keeps the search to the fixed grid (milliseconds for p <= 8).
    """
    assert v in (1, 2), v
    layouts = [linear_layout(pp, 1)] if v == 1 else [v_layout(pp), linear_layout(pp, 2)]
    c: Costs = as_costs(costs, layouts[0])
    act = activation_units(layouts[0], stage_bytes)
    unit = "bytes" if stage_bytes is not None else "M_B"
    need = [sum(act[s] for s in range(len(layouts[0])) if layouts[0][s] == r) for r in range(pp)]
    if stage_bytes is not None and v == 2:
        # Per-stage bytes follow the stage, so the two layouts put different bytes on a rank.
        need = [max(sum(stage_bytes[s] for s in range(2 * pp) if lay[s] == r) for lay in layouts) for r in range(pp)]
    if memory_limit is None:
        limit = [pp * x for x in need]  # 1F1B's budget: p microbatches in flight
    else:
        limit = [float(memory_limit)] * pp
        worst = max(range(pp), key=lambda r: need[r] - limit[r])
        if need[worst] > limit[worst] + EPS:
            raise ValueError(f"zb-auto: memory limit {memory_limit:g} {unit} is below the {need[worst]:g} {unit} one "
                             f"microbatch needs on rank {worst} (no order fits); use --memory-limit >= "
                             f"{need[worst]:g}")
    delays = comm_delays(len(layouts[0]), p2p_latency, None, None)

    def judge(label: str, sched: Schedule, makespan: float | None = None) -> Candidate:
        peak = peak_memory(sched, stage_bytes, i_free_fraction)
        fits = all(x <= lim + EPS * max(1.0, lim) for x, lim in zip(peak, limit))
        if not fits:
            t = float("inf")
        elif makespan is not None:  # the greedy's own clock is the replay's
            t = makespan
        else:
            t = simulate(sched, c, p2p_latency).makespan
        return Candidate(label, t, peak, fits, sched)

    # The fixed schedules that fit the same limit (listed after the greedy orders: on a tie the
    # greedy order wins), built first: in planner mode the fastest of them is the cutoff past
    # which a greedy run is abandoned.
    fixed: list[Candidate] = []
    if v == 1:
        warm = [max(0, min(pp - 1 - r, int(limit[r] / act[r] + EPS) - 1)) for r in range(pp)]
        # 1F1B needs warm-ups that never grow down the pipeline (rank r+1 cannot wait for more
        # forwards than rank r sends before its first backward).
        for r in range(1, pp):
            warm[r] = min(warm[r], warm[r - 1])
        one = [one_f_one_b_rank(pp, 1, m, r, warm[r], split=True, w_lag=0) for r in range(pp)]
        fixed.append(judge(f"1f1b(warm-up {warm})", make_schedule("zb-auto", pp, layouts[0], m, one)))
        if m >= pp:
            fixed.append(judge("zb-h1", _rename(zb_h1(pp, m, 1))))
            fixed.append(judge("zb-h2", _rename(zb_h2(pp, m))))
    else:
        if m >= 2 * pp:
            fixed.append(judge("zbv", _rename(zbv(pp, m))))
        fixed.append(judge("v-half", _rename(v_half(pp, m))))
        fixed.append(judge("v-min", _rename(v_min(pp, m))))
        if m % pp == 0:
            fixed.append(judge("zb-h1(interleaved)", _rename(zb_h1(pp, m, 2))))
            fixed.append(judge("interleaved-1f1b", _rename(interleaved_1f1b(pp, m, 2))))

    cands: list[Candidate] = []
    bound = makespan_bound(layouts, m, c, delays) if planner else -1.0
    cutoff = [min((x.makespan for x in fixed if x.fits), default=math.inf) if planner else math.inf]

    def add(cand: Candidate) -> bool:
        """Keep ``cand``; True when the search may stop (planner mode: it reaches the bound)."""
        cands.append(cand)
        if cand.fits:
            cutoff[0] = min(cutoff[0], cand.makespan) if planner else math.inf
        return cand.fits and cand.makespan <= bound * (1 + 1e-12)

    def run(lay, lay_act, knobs, rng=None):
        return greedy_order(lay, m, c, delays, lay_act, limit, knobs, i_free_fraction, rng=rng, cutoff=cutoff[0])

    stop = False
    for lay in layouts:
        shape = "" if v == 1 else ("V, " if lay[-1] == 0 else "interleaved, ")
        lay_act = activation_units(lay, stage_bytes)
        for knobs in auto_grid(v):
            res = run(lay, lay_act, knobs)
            if res is not None:
                label = f"greedy({shape}prefer={knobs.prefer}, w={knobs.w_policy}" + \
                    (f", warm-up slope={knobs.inflight_slope})" if v == 1 else ")")
                if stop := add(judge(label, make_schedule("zb-auto", pp, lay, m, res.order), res.makespan)):
                    break
        for i in range(effort if not stop else 0):
            knobs = Knobs(prefer=PREFER_ORDER[i % len(PREFER_ORDER)], w_policy="fit")
            res = run(lay, lay_act, knobs, random.Random(i))
            if res is not None and (stop := add(judge(f"restart({shape}seed {i})",
                                                      make_schedule("zb-auto", pp, lay, m, res.order), res.makespan))):
                break
        if stop:
            break
    cands += fixed
    cands.sort(key=lambda x: x.makespan)
    best = cands[0]
    if not best.fits:
        raise ValueError(f"zb-auto: no order for pp={pp}, m={m} fits {memory_limit:g} {unit} per rank; "
                         f"raise the memory limit")
    return best.schedule, cands


PREFER_ORDER = PREFER  # restart i uses PREFER_ORDER[i % 4]


def _rename(s: Schedule) -> Schedule:
    return make_schedule("zb-auto", s.pp, s.stage_to_rank, s.num_microbatches, _split(s), s.overlap)


def makespan_bound(layouts: Sequence[Sequence[int]], m: int, costs: Costs, delays: Sequence[float]) -> float:
    """A makespan no order of ``m`` microbatches on any of ``layouts`` goes below: some rank
    must run all its F, I and W passes after the first microbatch first reaches it (the F of
    every earlier stage, and the transfers between ranks on the way)."""
    best = math.inf
    for lay in layouts:
        pp = max(lay) + 1
        head, arrive = [math.inf] * pp, 0.0
        for s, r in enumerate(lay):
            head[r] = min(head[r], arrive)
            arrive += costs.f[s] + (delays[s] if s + 1 < len(lay) and lay[s + 1] != r else 0.0)
        work = [0.0] * pp
        for s, r in enumerate(lay):
            work[r] += m * (costs.f[s] + costs.i[s] + costs.w[s])
        best = min(best, max(h + w for h, w in zip(head, work)))
    return best


def zb_auto(pp: int, m: int, v: int = 1, costs=None, memory_limit: float | None = None, p2p_latency: float = 0.0,
            stage_bytes: Sequence[float] | None = None, i_free_fraction: float = 0.5, effort: int = 0) -> Schedule:
    """zb-auto's best schedule (:func:`search_zb_auto` in planner mode: as fast as the whole
    search's, sooner)."""
    return search_zb_auto(pp, m, v, costs, memory_limit, p2p_latency, stage_bytes, i_free_fraction, effort,
                          planner=True)[0]
