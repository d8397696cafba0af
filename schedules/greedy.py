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


def greedy_order(stage_to_rank: Sequence[int], m: int, costs: Costs, delays: Sequence[float],
                 act: Sequence[float], limit: Sequence[float], knobs: Knobs,
                 i_free_fraction: float = 0.5, rng: random.Random | None = None) -> GreedyResult | None:
    """Per-rank action lists, or None when this knob setting cannot finish (it should always).

    With ``rng`` the decisions are perturbed for randomized restarts: a random pass among those
    ready now (probability 0.2), and a W in a gap it does not fit (probability 0.3). The
    correctness rules above still hold, so every restart finishes.

    ``delays[b]``: transfer time across boundary b when its two stages sit on different ranks.
    ``act[s]``: memory an F of stage s keeps; ``limit[r]``: rank r's budget in the same unit.
    """
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

    def f_state(r: int, s: int):
        """(ready time or None, admissible, blocked_by_memory) of stage s's next F."""
        k = nf[s]
        if s == 0:
            ready = 0.0
        else:
            e = end_f[s - 1][k]
            if e is None:
                return None, False, False
            ready = e + hop[s - 1]
        need = act[s] + (reserve[r] if s == entry[r] else 0.0)
        if s == entry[r] and nf[s] - ni[s] >= cap[r]:
            return ready, False, False
        if mem[r] + need > limit[r] + eps:
            return ready, False, True
        return ready, True, False

    def i_ready(s: int):
        k = ni[s]
        e = end_f[s][k]
        if s < S - 1:
            g = end_g[s + 1][k]
            if g is None:
                return None
            e = max(e, g + hop[s])
        return e

    # Priority among passes ready at once, as one integer per (kind, stage[, microbatch]); lower wins.
    prefer = knobs.prefer
    base = {}
    for s_ in range(S):
        if prefer == "F":
            base[(F, s_)], base[(I, s_)] = S - s_, 2 * S - s_
        elif prefer == "deep":
            base[(I, s_)], base[(F, s_)] = 2 * (S - s_), 2 * (S - s_) + 1
        else:  # "I" and "old": backward first, deeper stage first
            base[(I, s_)], base[(F, s_)] = S - s_, 2 * S - s_
    old = prefer == "old"
    stride = 2 * S + 2
    w_policy = knobs.w_policy
    cost_w = costs.w

    def decide(r: int):
        """(start, kind, stage) of rank r's next action, or (INF, None, None) to wait."""
        t = free[r]
        q = wq[r]
        if q and (w_policy == "immediate" or left_fi[r] == 0):
            return t, W, q[0][0]
        cands = []  # (ready, priority, kind, stage)
        mem_blocked = False
        for s in local[r]:
            k = ni[s]
            if k < nf[s]:
                e = i_ready(s)
                if e is not None:
                    cands.append((e, base[(I, s)] + (k * stride if old else 0), I, s))
            k = nf[s]
            if k < m:
                e, ok, blocked = f_state(r, s)
                if blocked:
                    mem_blocked = True
                if ok:
                    cands.append((e, base[(F, s)] + (k * stride if old else 0), F, s))
        if cands:
            lim = t + eps
            best = None
            for c in cands:
                if c[0] <= lim and (best is None or c[1] < best[1]):
                    best = c
            if best is not None and rng is not None and rng.random() < 0.2:
                best = rng.choice([c for c in cands if c[0] <= lim])
            if best is not None:
                return t, best[2], best[3]
        if mem_blocked and q:
            return t, W, q[0][0]
        nxt = min(cands)[0] if cands else INF  # earliest ready; on a tie the preferred one
        if q:
            w_end = t + cost_w[q[0][0]]
            if w_policy == "eager" or (w_policy == "fit" and (nxt == INF or w_end <= nxt + eps)) or \
                    (w_policy == "strict" and nxt < INF and w_end <= nxt + eps) or \
                    (rng is not None and rng.random() < 0.3):
                return t, W, q[0][0]
        if nxt == INF:
            return INF, None, None
        c = min(cands)
        return c[0], c[2], c[3]

    nxt_event = [decide(r) for r in range(pp)]
    version = [0] * pp
    heap = [(nxt_event[r][0], r, 0) for r in range(pp)]  # stale entries are skipped by version
    heapq.heapify(heap)
    remaining = sum(3 * m * len(st) for st in local)
    while remaining:
        while heap[0][2] != version[heap[0][1]]:
            heapq.heappop(heap)
        _, r, _ = heapq.heappop(heap)
        start, kind, s = nxt_event[r]
        if start == INF:
            return None
        touched = {r}
        if kind == F:
            k = nf[s]
            end = start + costs.f[s]
            end_f[s][k] = end
            nf[s] += 1
            mem[r] += act[s]
            left_fi[r] -= 1
            if s + 1 < S:
                touched.add(owner[s + 1])
        elif kind == I:
            k = ni[s]
            end = start + costs.i[s]
            end_g[s][k] = end
            ni[s] += 1
            mem[r] -= act[s] * i_free_fraction
            wq[r].append((s, k))
            left_fi[r] -= 1
            if s > 0:
                touched.add(owner[s - 1])
        else:
            s, k = wq[r].popleft()
            end = start + costs.w[s]
            mem[r] -= act[s] * (1.0 - i_free_fraction)
        out[r].append(Action(s, kind, k))
        free[r] = end
        remaining -= 1
        for q in touched:
            nxt_event[q] = decide(q)
            version[q] += 1
            heapq.heappush(heap, (nxt_event[q][0], q, version[q]))
    return GreedyResult(out, max(free))
