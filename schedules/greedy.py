"""Cost-aware greedy list scheduler under a per-rank memory limit.

This is the building block of zb-auto (the Zero Bubble paper's automatic scheduler
heuristic, arXiv 2401.10241 §3.1) and of the memory-capped fixed schedules zb-h2 and
v-half. It walks simulated time: whenever a rank is free it picks, among the actions whose
inputs exist, a backward (I) or a forward (F) by the ``prefer`` knob; W passes fill the gaps
(``w_policy``) or are forced when the next F would exceed the memory limit.

Correctness (no rank waits forever) rests on two rules, both about the *oldest* unfinished
microbatch, which must always be able to move:

* per stage, F and I run in increasing microbatch order;
* a rank admits a microbatch into its first (entry) stage only if, afterwards, the memory
  for that microbatch's later stages on the same rank still fits (for the V layout: the
  chunk-1 activation). Any held W can always run to free memory.

So this engine supports 1 stage per rank, or 2 in any layout where a microbatch visits a rank
twice; more visits would need a larger reservation and are rejected.

Decisions are made in global time order (the rank whose next start is earliest goes first),
so a decision never misses an input that some other rank could still produce earlier.
"""
from __future__ import annotations

import heapq
import math
import random
from collections import deque
from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence

from autopar.schedules.costs import Costs
from autopar.schedules.ir import Action, F, I, W

INF = math.inf
W_POLICIES = ("fit", "strict", "eager", "lazy", "immediate")
PREFER = ("I", "F", "old", "deep")


@dataclass(frozen=True)
class Knobs:
    """One point of the heuristic's search grid.

    prefer: among the passes ready now: "I" a backward before a forward (drains memory,
        1F1B-like); "F" the reverse (fills the pipeline deeper); "old" the oldest microbatch;
        "deep" the stage closest to the loss. Ties go to the deeper stage.
    w_policy: when a rank has nothing ready it may run a held W:
        "fit"    if the W ends before the next known input arrives (or none is known yet),
        "strict" only if it ends before the next known input arrives,
        "eager"  always,
        "lazy"   only when memory forces it or no F/I is left,
        "immediate" a W right after its I (B split in place).
    inflight_slope: linear layouts only. Rank r keeps at most (p - r) + round(slope * (p-1-r))
        microbatches between F and I of its stage (0: 1F1B's warm-up, 1: ZB-H2's);
        None: only the memory limit bounds it.
    inflight_max: any layout. At most this many microbatches per rank between entering the
        rank and the backward of its entry stage (None: no such cap). Tight-memory V
        schedules need it: admitting early microbatches greedily starves the chunk-1 ones.
    """

    prefer: str = "I"
    w_policy: str = "fit"
    inflight_slope: float | None = None
    inflight_max: int | None = None

    def __post_init__(self):
        assert self.prefer in PREFER, self.prefer
        assert self.w_policy in W_POLICIES, self.w_policy


@dataclass(frozen=True)
class GreedyResult:
    order: list[list[Action]]  # per rank
    makespan: float  # equals simulate(order, same costs and delays).makespan: starts are as early as possible


# Orders already built, keyed by everything but the memory limit: (stage_to_rank, m, costs,
# delays, act, knobs, i_free_fraction) -> [(lowest, highest, result)], where the run compared
# the limit of rank r only against amounts it admitted (<= lowest[r]) or refused (> highest[r]):
# any limit between gives the same comparisons, hence the same order. The planner prices one
# (pp, m, costs) under many limits (the ZeRO levels and data-parallel degrees of a layout
# family differ in their states only). Keyed by content; bounded (the oldest key goes first).
_BUILT: dict = {}
_BUILT_MAX = 4096


def greedy_order(stage_to_rank: Sequence[int], m: int, costs: Costs, delays: Sequence[float],
                 act: Sequence[float], limit: Sequence[float], knobs: Knobs,
                 i_free_fraction: float = 0.5, rng: random.Random | None = None,
                 cutoff: float = INF) -> GreedyResult | None:
    """Per-rank action lists, or None when this knob setting cannot finish (it should always),
    or when it cannot finish by ``cutoff``: the run is abandoned as soon as some rank's clock
    plus the work it still has to place passes it. Deterministic: a repeated request (any limit
    that makes the same comparisons) is answered from ``_BUILT``.

    With ``rng`` the decisions are perturbed for randomized restarts: a random pass among those
    ready now (probability 0.2), and a W in a gap it does not fit (probability 0.3). The
    correctness rules above still hold, so every restart finishes.

    ``delays[b]``: transfer time across boundary b when its two stages sit on different ranks.
    ``act[s]``: memory an F of stage s keeps; ``limit[r]``: rank r's budget in the same unit.
    """
    if rng is not None:
        res = _greedy_order(stage_to_rank, m, costs, delays, act, limit, knobs, i_free_fraction, rng, None, cutoff)
        return None if res is _ABANDONED else res
    key = (tuple(stage_to_rank), m, costs, tuple(delays), tuple(act), knobs, i_free_fraction)
    eps = 1e-12
    for lowest, highest, res in _BUILT.get(key, ()):
        if all(lo <= x + eps < hi for lo, x, hi in zip(lowest, limit, highest)):
            return res if res is None or res.makespan <= cutoff * (1 + eps) else None
    seen = ([-INF] * len(limit), [INF] * len(limit))
    res = _greedy_order(stage_to_rank, m, costs, delays, act, limit, knobs, i_free_fraction, None, seen, cutoff)
    if res is _ABANDONED:
        return None
    if key not in _BUILT and len(_BUILT) >= _BUILT_MAX:
        del _BUILT[next(iter(_BUILT))]
    _BUILT.setdefault(key, []).append((tuple(seen[0]), tuple(seen[1]), res))
    return res


_ABANDONED = GreedyResult([], INF)  # a run stopped at its cutoff (not memoized)


@lru_cache(maxsize=1 << 16)
def _action(stage: int, kind: str, microbatch: int) -> Action:
    """One Action per (stage, kind, microbatch): the orders share them (Actions are immutable)."""
    return Action(stage, kind, microbatch)


def _greedy_order(stage_to_rank, m, costs, delays, act, limit, knobs, i_free_fraction, rng, seen, cutoff=INF):
    """``greedy_order``'s run; ``seen`` (when given) collects per rank the largest amount
    admitted under the limit and the smallest refused."""
    S = len(stage_to_rank)
    pp = max(stage_to_rank) + 1
    owner = tuple(stage_to_rank)
    local = [[s for s in range(S) if owner[s] == r] for r in range(pp)]
    assert all(1 <= len(st) <= 2 for st in local), "greedy supports 1 or 2 stages per rank"
    entry = [st[0] for st in local]
    # Memory one microbatch still needs on its rank after entering: the later local stages.
    reserve = [sum(act[s] for s in st[1:]) for st in local]
    if knobs.inflight_slope is not None:
        cap = [(pp - r) + round(knobs.inflight_slope * (pp - 1 - r)) for r in range(pp)]
    else:
        cap = [m] * pp
    if knobs.inflight_max is not None:
        cap = [min(c, knobs.inflight_max) for c in cap]
    hop = [0.0] * S  # delay into stage s+1 / out of stage s+1, zero on the same rank
    for b in range(S - 1):
        hop[b] = delays[b] if owner[b] != owner[b + 1] else 0.0
    eps = 1e-12

    end_f = [[None] * m for _ in range(S)]
    end_g = [[None] * m for _ in range(S)]
    nf = [0] * S
    ni = [0] * S
    wq: list[deque] = [deque() for _ in range(pp)]
    mem = [0.0] * pp
    free = [0.0] * pp
    out: list[list[Action]] = [[] for _ in range(pp)]
    left_fi = [2 * m * len(local[r]) for r in range(pp)]  # F and I still to place per rank

    # Priority among passes ready at once, as one integer per (kind, stage[, microbatch]); lower wins.
    prefer = knobs.prefer
    base_i, base_f = [0] * S, [0] * S
    for s_ in range(S):
        if prefer == "F":
            base_f[s_], base_i[s_] = S - s_, 2 * S - s_
        elif prefer == "deep":
            base_i[s_], base_f[s_] = 2 * (S - s_), 2 * (S - s_) + 1
        else:  # "I" and "old": backward first, deeper stage first
            base_i[s_], base_f[s_] = S - s_, 2 * S - s_
    stride = 2 * S + 2 if prefer == "old" else 0
    w_policy = knobs.w_policy
    cost_w = costs.w
    # per rank: (stage, is its entry stage, the stage before it or -1, the stage after it or -1,
    # hop in, hop out, F's memory need, its I and F priorities)
    plan = [[(s_, s_ == entry[r], s_ - 1, s_ + 1 if s_ < S - 1 else -1, hop[s_ - 1] if s_ else 0.0, hop[s_],
              act[s_] + (reserve[r] if s_ == entry[r] else 0.0), base_i[s_], base_f[s_]) for s_ in local[r]]
            for r in range(pp)]

    def decide(r: int):
        """(start, kind, stage) of rank r's next action, or (INF, None, None) to wait.

        Among the passes whose inputs exist: the preferred one (lowest priority) of those ready
        by the rank's clock; else a W (memory forces it, or ``w_policy`` lets it fill the wait);
        else the earliest ready (on a tie the preferred one)."""
        t = free[r]
        q = wq[r]
        if q and (w_policy == "immediate" or left_fi[r] == 0):
            return t, W, q[0][0]
        offers = []  # (ready, priority, kind, stage) of every pass whose inputs exist
        mem_blocked = False
        lim_r = limit[r] + eps
        for s, is_entry, before, after, hop_in, hop_out, need, prio_i, prio_f in plan[r]:
            k = ni[s]
            if k < nf[s]:  # the next I: its F done, and the gradient from the stage after it
                e = end_f[s][k]
                if after >= 0:
                    g = end_g[after][k]
                    e = None if g is None else max(e, g + hop_out)
                if e is not None:
                    offers.append((e, prio_i + k * stride, I, s))
            k = nf[s]
            if k < m:  # the next F: its input there, room in flight and in memory
                if before < 0:
                    e = 0.0
                else:
                    e = end_f[before][k]
                    if e is None:
                        continue
                    e += hop_in
                if is_entry and k - ni[s] >= cap[r]:
                    continue
                amount = mem[r] + need
                if amount > lim_r:
                    if seen is not None and amount < seen[1][r]:
                        seen[1][r] = amount
                    mem_blocked = True
                    continue
                if seen is not None and amount > seen[0][r]:
                    seen[0][r] = amount
                offers.append((e, prio_f + k * stride, F, s))
        lim = t + eps
        best = first = None  # the preferred offer ready by lim; the earliest (priorities are unique)
        for offer in offers:
            if offer[0] <= lim and (best is None or offer[1] < best[1]):
                best = offer
            if first is None or offer < first:
                first = offer
        if best is not None:
            if rng is not None and rng.random() < 0.2:
                _e, _p, kind, s = rng.choice([o for o in offers if o[0] <= lim])
                return t, kind, s
            return t, best[2], best[3]
        if mem_blocked and q:
            return t, W, q[0][0]
        nxt = first[0] if first is not None else INF
        if q:
            w_end = t + cost_w[q[0][0]]
            if w_policy == "eager" or (w_policy == "fit" and (nxt == INF or w_end <= nxt + eps)) or \
                    (w_policy == "strict" and nxt < INF and w_end <= nxt + eps) or \
                    (rng is not None and rng.random() < 0.3):
                return t, W, q[0][0]
        if nxt == INF:
            return INF, None, None
        return first[0], first[2], first[3]

    nxt_event = [decide(r) for r in range(pp)]
    version = [0] * pp
    heap = [(nxt_event[r][0], r, 0) for r in range(pp)]  # stale entries are skipped by version
    heapq.heapify(heap)
    remaining = sum(3 * m * len(st) for st in local)
    todo = [m * sum(costs.f[s] + costs.i[s] + costs.w[s] for s in st) for st in local]  # work left per rank
    give_up = cutoff * (1 + 1e-12)
    cost_f, cost_i = costs.f, costs.i
    pop, push = heapq.heappop, heapq.heappush
    while remaining:
        while heap[0][2] != version[heap[0][1]]:
            pop(heap)
        _, r, _ = pop(heap)
        start, kind, s = nxt_event[r]
        if start == INF:
            return None
        other = -1  # the rank whose input this action makes, when another
        if kind == F:
            k = nf[s]
            cost = cost_f[s]
            end_f[s][k] = start + cost
            nf[s] += 1
            mem[r] += act[s]
            left_fi[r] -= 1
            if s + 1 < S:
                other = owner[s + 1]
        elif kind == I:
            k = ni[s]
            cost = cost_i[s]
            end_g[s][k] = start + cost
            ni[s] += 1
            mem[r] -= act[s] * i_free_fraction
            wq[r].append((s, k))
            left_fi[r] -= 1
            if s > 0:
                other = owner[s - 1]
        else:
            s, k = wq[r].popleft()
            cost = cost_w[s]
            mem[r] -= act[s] * (1.0 - i_free_fraction)
        end = start + cost
        out[r].append(_action(s, kind, k))
        free[r] = end
        remaining -= 1
        todo[r] -= cost
        if end + todo[r] > give_up:
            return _ABANDONED
        # decide again for the rank that ran and the one it fed (lower rank first: a randomized
        # restart draws in that order)
        for q in ((r,) if other < 0 or other == r else (r, other) if r < other else (other, r)):
            nxt_event[q] = ev = decide(q)
            version[q] += 1
            push(heap, (ev[0], q, version[q]))
    return GreedyResult(out, max(free))
