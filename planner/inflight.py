"""What each pipeline rank holds between F and I/W, read off a fixed schedule's action order
without walking the whole schedule at every microbatch count: per-rank frontiers of in-flight
counts (activation peaks for any per-stage amounts), microbatches in flight per stage (the P2P
term), and the fixed-order schedules themselves (cached, validated up to a size)."""
from __future__ import annotations

from functools import lru_cache

from autopar.schedules import build
from autopar.schedules.ir import F as _F
from autopar.schedules.ir import I as _I
from autopar.schedules.ir import W as _W

# ---------------------------------------------------------------------------------------------
# activation peaks without building full schedules
#
# A fixed schedule's per-rank activation peak is a maximum over its action positions of
# sum_s nF[s] * after_f[s] + nI[s] * after_i[s], where nF / nI count the microbatches of stage s
# past their F (not yet I/B) and past their I (not yet W) at that position. The amounts are
# >= 0, so only the count vectors no other one dominates matter (the rank's *frontier*); the
# peak for any amounts is the largest dot product with them. Past a schedule's warm-up the
# frontier no longer changes with m: ``_STEADY`` gives the m from which it is the same as at
# that m (checked against the built schedules on a grid of (pp, m, v) in
# tests/unit/test_planner.py); gpipe's is closed-form (every F before any B); v-half and
# zb-h2 (greedy orders searched per (pp, m)) are built at their own m.
_STEADY = {
    "1f1b": lambda p, v: p,
    "zb-h1": lambda p, v: p * v,
    "interleaved-1f1b": lambda p, v: p * v,
    "zbv": lambda p, v: 2 * p,
    "dualpipev": lambda p, v: 2 * p,
    "v-min": lambda p, v: p,
}


def steady_m(name: str, pp: int, m: int, v: int) -> int:
    """The microbatch count whose built schedule has the same per-rank frontier as (pp, m, v)."""
    cap = _STEADY.get(name)
    if cap is None:
        return m
    c = cap(pp, v)
    return c if m > c else m


@lru_cache(maxsize=8192)
def inflight_frontier(name: str, pp: int, m: int, v: int) -> tuple:
    """Per rank: (its stages, the undominated (nF per stage..., nI per stage...) count vectors).
    The steady schedules are made by their generator without ``registry.build``'s validation
    (the frontier equals the validated schedule's: tests/unit/test_planner.py); the greedy ones
    through ``registry.build`` (cached there)."""
    from autopar.schedules.registry import layout as stage_layout

    if name == "gpipe":  # all m forwards, then fused backwards: m microbatches at the peak
        s2r = stage_layout(name, pp, v)
        return tuple((tuple(s for s in range(len(s2r)) if s2r[s] == r),) + (((m,) * v + (0,) * v,),)
                     for r in range(pp))
    m_eff = steady_m(name, pp, m, v)
    if m_eff != m:
        return inflight_frontier(name, pp, m_eff, v)
    return tuple((stages, tuple(sorted(_undominated({after for _, t, _, after in steps if t in (_F, _I)}))))
                 for stages, steps in _count_walk(name, pp, m, v))


def _count_walk(name: str, pp: int, m: int, v: int) -> list:
    """Per rank of a fixed-order schedule: (its stages, per action (counts before, type, index
    of its stage among the rank's, counts after)), the counts being the microbatches of each
    of the rank's stages past F (not yet I/B), then past I (not yet W). The steady schedules
    are made by their generator without ``registry.build``'s validation; the greedy ones
    through ``registry.build`` (cached there)."""
    from autopar.schedules.registry import get

    sched = get(name).make(pp, m, v) if name in _STEADY else fixed_schedule(name, pp, m, v)
    s2r = sched.stage_to_rank
    out = []
    for r, acts in enumerate(sched.actions):
        stages = tuple(s for s in range(len(s2r)) if s2r[s] == r)
        idx = {s: j for j, s in enumerate(stages)}
        k = len(stages)
        st = [0] * (2 * k)
        steps = []
        for a in acts:
            j, t = idx[a.stage], a.type
            before = tuple(st)
            if t == _F:
                st[j] += 1
            elif t == _I:
                st[j] -= 1
                st[k + j] += 1
            elif t == _W:
                st[k + j] -= 1
            else:  # B
                st[j] -= 1
            steps.append((before, t, j, tuple(st)))
        out.append((stages, steps))
    return out


def _undominated(vectors, counts=lambda p: p) -> list:
    """The members of ``vectors`` whose ``counts`` no other member's are all at least."""
    keep: list = []
    for p in sorted(vectors, key=counts, reverse=True):
        if not any(all(x >= y for x, y in zip(counts(q), counts(p))) for q in keep):
            keep.append(p)
    return keep


@lru_cache(maxsize=8192)
def stage_inflight(name: str, pp: int, m: int, v: int) -> tuple[int, ...]:
    """Per stage: the most microbatches it holds between their F and their I/B at once (from
    the schedule's in-flight frontier)."""
    from autopar.schedules.registry import layout as stage_layout

    out = [0] * len(stage_layout(name, pp, v))
    for stages, vecs in inflight_frontier(name, pp, m, v):
        for j, s in enumerate(stages):
            out[s] = max((vec[j] for vec in vecs), default=0)
    return tuple(out)


def frontier_peaks(frontier, after_f, after_i) -> tuple[float, ...]:
    """Per-rank peaks of ``inflight_frontier`` for per-stage amounts after F and after I."""
    peaks = []
    for stages, vecs in frontier:
        amounts = [after_f[s] for s in stages] + [after_i[s] for s in stages]
        peaks.append(max((sum(c * a for c, a in zip(vec, amounts) if c) for vec in vecs), default=0.0))
    return tuple(max(0.0, p) for p in peaks)


def max_inflight(frontier, skip_stage0: bool = True) -> tuple[int, ...]:
    """Per rank: the most stage-microbatches holding activations at once (stage 0's left out
    when ``skip_stage0``: a recomputing stage 0 keeps only the token ids)."""
    out = []
    for stages, vecs in frontier:
        k = len(stages)
        keep = [j for j, s in enumerate(stages) if not (skip_stage0 and s == 0)]
        out.append(max((sum(vec[j] + vec[k + j] for j in keep) for vec in vecs), default=0))
    return tuple(out)


# A fixed-order schedule (every one but zb-auto) is a function of (name, pp, m, v) alone.
# ``registry.build`` validates each one it makes (every dependency, position and count), which at
# pp*m in the tens of thousands costs seconds per schedule, more than making and simulating it:
# past this many actions the planner takes the generator's schedule as it is (the generators
# are validated over grids of (pp, m, v) by the schedule tests, and the runtime validates the
# schedule it runs through ``registry.build``); constraints are still checked.
VALIDATE_MAX_ACTIONS = 20_000


@lru_cache(maxsize=32)
def fixed_schedule(name: str, pp: int, m: int, v: int):
    """The schedule ``registry.build(name, pp, m, v)`` returns (a fixed-order one), validated when
    it has at most ``VALIDATE_MAX_ACTIONS`` actions."""
    from autopar.schedules.registry import check, get

    if 3 * pp * v * m <= VALIDATE_MAX_ACTIONS or get(name).searched:
        return build(name, pp, m, v)
    v = check(name, pp, m, v)
    return get(name).make(pp, m, v)
