"""The stage-boundary ILP (PuLP): which units each stage holds and which stages recompute,
minimizing the busiest rank's time per microbatch with every rank's memory within the limit.

Units come in runs of identical units (``ModelProfile.runs``: the prologue, 3 dense layers,
58 MoE layers, the epilogue ...). Integer ``y[s]`` is the number of units in stages 0..s-1;
``a[s][k] = clip(y[s] - P_k, 0, L_k)`` (units of run k before boundary s) is encoded exactly
with two binaries per (boundary, run), so stage s holds ``a[s+1][k] - a[s][k]`` units of run k.
The model size is O(stages x runs), not O(stages x layers): 126 identical layers cost one run.

Memory uses the schedule's own accounting: walking each rank's action order, the saved
activations alive after every F are ``sum_s c[s] * A_s`` with fixed live counts ``c`` (I frees
the share ``i_free_fraction``, W the rest), so "peak <= limit" becomes one linear constraint
per distinct live-count vector. A recomputing stage keeps only its input (``A_s`` = input
bytes) and replays its forward inside I.
"""
from __future__ import annotations

import time
import warnings
from dataclasses import dataclass

import pulp

from autopar.passes.zero_layout import MASTER_BYTES
from autopar.schedules.ir import B, F, I, W

from .estimate import Evaluator, GiB, Layout, Partition, runtime_overhead


@dataclass(frozen=True)
class ILPResult:
    partition: Partition | None
    status: str          # "optimal", "time limit (feasible, not proven optimal)", "infeasible", ...
    objective: float | None
    bound: float         # a lower bound on the objective (perfectly balanced ranks)
    seconds: float

    @property
    def gap(self) -> float | None:
        if self.objective is None or self.objective <= 0:
            return None
        return max(0.0, (self.objective - self.bound) / self.objective)


def live_vectors(schedule, frac: float) -> list[list[dict[int, float]]]:
    """Per rank: the distinct stage -> live-microbatch-count vectors after each F (peak candidates)."""
    out = []
    for acts in schedule.actions:
        live: dict[int, float] = {}
        vecs, seen = [], set()
        for a in acts:
            s = a.stage
            if a.type == F:
                live[s] = live.get(s, 0.0) + 1.0
                key = tuple(sorted((k, round(v, 9)) for k, v in live.items() if v > 1e-12))
                if key not in seen:
                    seen.add(key)
                    vecs.append(dict(key))
            elif a.type == I:
                live[s] = live.get(s, 0.0) - frac
            elif a.type == W:
                live[s] = live.get(s, 0.0) - (1.0 - frac)
            elif a.type == B:
                live[s] = live.get(s, 0.0) - 1.0
        out.append(_pareto(vecs))
    return out


def _pareto(vecs: list[dict[int, float]]) -> list[dict[int, float]]:
    """Drop vectors dominated by another (every count <=): they can never be the peak."""
    keys = sorted({k for v in vecs for k in v})
    pts = sorted({tuple(v.get(k, 0.0) for k in keys) for v in vecs}, reverse=True)
    if len(keys) <= 2:  # sweep: sorted by the first count, keep strictly rising second counts
        front, best2 = [], -1.0
        for p in pts:
            second = p[1] if len(keys) == 2 else 0.0
            if second > best2 + 1e-12 or not front:
                front.append(p)
                best2 = max(best2, second)
    else:
        front = [p for p in pts if not any(q != p and all(a >= b for a, b in zip(q, p)) for q in pts)]
    return [{k: x for k, x in zip(keys, p) if x > 1e-12} for p in front]


# the solver's work budget per stage-boundary ILP (branch-and-bound nodes) and the relative gap
# at which it stops as optimal: work counts, so the answer never depends on the machine's speed
DEFAULT_NODES = 300
GAP_REL = 1e-4


def solve_partition(ev: Evaluator, lay: Layout, schedule, frac: float, allow_recompute: bool = True,
                    max_nodes: int = DEFAULT_NODES, warm: Partition | None = None) -> ILPResult:
    """``warm``: a partition to start the solver from (e.g. the balanced one), so a solve that
    stops at its node budget returns at least that when it fits. The budget is branch-and-bound
    nodes, never seconds: the same input gives the same partition on every machine."""
    t0 = time.perf_counter()
    runs = ev.profile.runs()
    K = len(runs)
    S = lay.num_stages
    U = sum(n for _, n in runs)
    s2r = schedule.stage_to_rank
    starts = []
    acc = 0
    for _, n in runs:
        starts.append(acc)
        acc += n
    sc = ev.scale(lay)
    t_unit = [sum(ev.unit_times(k, lay)) for k, _ in runs]
    f_unit = [ev.unit_times(k, lay)[0] for k, _ in runs]
    act_unit = [k.saved_bytes * sc for k, _ in runs]
    in_max = max(k.in_bytes for k, _ in runs) * sc
    stat_unit = [ilp_unit_static(ev, k, lay) for k, _ in runs]
    # CBC needs coefficients of similar size: times in units of the slowest unit, bytes in GiB
    TS = max(t_unit) or 1.0
    MS = float(GiB)
    t_unit = [t / TS for t in t_unit]
    f_unit = [t / TS for t in f_unit]
    act_unit = [x / MS for x in act_unit]
    in_max /= MS
    stat_unit = [x / MS for x in stat_unit]
    limit = ev.memory_limit / MS
    # per-rank memory the boundaries do not move: the prologue run only ever sits on stage 0's
    # rank and the epilogue run on the last stage's, so their working sets count only there
    units = ev.profile.units
    head = 1 if units[0].name == "prologue" and runs[0][1] == 1 and K > 1 else 0
    tail = 1 if units[-1].name == "epilogue" and runs[-1][1] == 1 and K - head > 1 else 0
    middle = runs[head: K - tail]

    def fixed_for(rank: int) -> float:
        held = list(middle)
        if head and s2r[0] == rank:
            held.append(runs[0])
        if tail and s2r[S - 1] == rank:
            held.append(runs[-1])
        work = max(k.work(sc) for k, _ in held)
        out_max = max(max(k.out_bytes, k.in_bytes) for k, _ in held) * sc
        return sum(_fixed_memory(ev, lay, work, out_max).values()) / MS

    prob = pulp.LpProblem("stage_boundaries", pulp.LpMinimize)
    y = [_var(prob, f"y{s}", lowBound=0, upBound=U, cat="Integer") for s in range(S + 1)]
    prob += y[0] == 0
    prob += y[S] == U
    for s in range(S):
        prob += y[s + 1] >= y[s] + 1
    a = {}
    binaries = {}
    for s in range(S + 1):
        for k in range(K):
            P, L = starts[k], runs[k][1]
            if s == 0:
                a[s, k] = 0
                continue
            if s == S:
                a[s, k] = L
                continue
            lo = _var(prob, f"lo{s}_{k}", cat="Binary")   # y <= P: none of run k yet
            hi = _var(prob, f"hi{s}_{k}", cat="Binary")   # y >= P + L: all of run k
            av = _var(prob, f"a{s}_{k}", lowBound=0, upBound=L)
            M = U + L
            prob += lo + hi <= 1
            prob += y[s] <= P + M * (1 - lo)
            prob += y[s] >= P + 1 - M * lo - M * hi
            prob += y[s] >= P + L - M * (1 - hi)
            prob += y[s] <= P + L - 1 + M * hi + M * lo
            prob += av <= L * (1 - lo)
            prob += av >= L * hi
            prob += av <= y[s] - P + M * lo
            prob += av >= y[s] - P - M * (lo + hi)
            a[s, k] = av
            binaries[s, k] = (lo, hi)
    n = {(s, k): a[s + 1, k] - a[s, k] for s in range(S) for k in range(K)}
    r = [_var(prob, f"r{s}", cat="Binary") if allow_recompute else 0 for s in range(S)]
    t_max = sum(t * L for t, (_, L) in zip(t_unit, runs))
    f_max = sum(t * L for t, (_, L) in zip(f_unit, runs))
    a_max = sum(x * L for x, (_, L) in zip(act_unit, runs))
    extra, act = [], []
    for s in range(S):
        fs = pulp.lpSum(n[s, k] * f_unit[k] for k in range(K))
        ac = pulp.lpSum(n[s, k] * act_unit[k] for k in range(K))
        if allow_recompute:
            e = _var(prob, f"e{s}", lowBound=0)
            prob += e >= fs - f_max * (1 - r[s])
            A = _var(prob, f"A{s}", lowBound=0)
            prob += A >= ac - a_max * r[s]
            prob += A >= in_max * r[s]
            extra.append(e)
            act.append(A)
        else:
            extra.append(0)
            act.append(ac)
    z = _var(prob, "z", lowBound=0)
    for rank in range(lay.pp):
        stages = [s for s in range(S) if s2r[s] == rank]
        prob += z >= pulp.lpSum(pulp.lpSum(n[s, k] * t_unit[k] for k in range(K)) + extra[s] for s in stages)
    for rank, vecs in enumerate(live_vectors(schedule, frac)):
        stages = [s for s in range(S) if s2r[s] == rank]
        static = pulp.lpSum(n[s, k] * stat_unit[k] for s in stages for k in range(K))
        for v in vecs:
            prob += static + pulp.lpSum(c * act[s] for s, c in v.items()) + fixed_for(rank) <= limit
    # prefer no recomputation at equal time (tiny weight: a tie-breaker, never a trade)
    prob += z + (t_max * 1e-6 / max(S, 1)) * pulp.lpSum(r)
    if warm is not None and len(warm.bounds) == S + 1:
        _set_warm_start(warm, y, a, binaries, r, extra, act, z, runs, starts, f_unit, act_unit, t_unit,
                        in_max, f_max, a_max, s2r, lay.pp, allow_recompute)
    solver = make_solver(max_nodes, warm_start=warm is not None)
    prob.solve(solver)
    secs = time.perf_counter() - t0
    bound = t_max * TS / lay.pp  # seconds
    status = pulp.LpStatus[prob.status]
    if status != "Optimal" or prob.sol_status not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
        return ILPResult(None, "infeasible" if status == "Infeasible" else status.lower(), None, bound, secs)
    ys = [int(round(pulp.value(v))) if not isinstance(v, int) else v for v in y]
    rc = tuple(bool(round(pulp.value(x))) if allow_recompute else False for x in r)
    label = "optimal"
    if prob.sol_status == pulp.LpSolutionIntegerFeasible:
        label = f"node limit {max_nodes} (feasible, not proven optimal)"
    return ILPResult(Partition(tuple(ys), rc), label, float(pulp.value(z)) * TS, bound, secs)


def _var(prob, name: str, lowBound=None, upBound=None, cat: str = "Continuous"):
    add = getattr(prob, "add_variable", None)  # PuLP >= 3.3; LpVariable(...) before
    if add is not None:
        return add(name, lowBound, upBound, cat)
    return pulp.LpVariable(name, lowBound=lowBound, upBound=upBound, cat=cat)


def solver_name() -> str:
    return "HiGHS" if _highs_available() else "CBC"


def _highs_available() -> bool:
    try:
        return bool(pulp.HiGHS(msg=False).available())
    except Exception:  # noqa: BLE001 - any failure means: not usable
        return False


class _HiGHS(pulp.HiGHS):
    """PuLP's in-process HiGHS, reading a stop at the node budget as PuLP reads CBC's: stopped
    with a feasible solution (HiGHS >= 1.10 reports ``kSolutionLimit`` there, a status PuLP 3.3
    does not map: its lookup fails after the values were assigned)."""

    def findSolutionValues(self, lp):
        try:
            return super().findSolutionValues(lp)
        except KeyError:
            feasible = lp.solverModel.getInfo().primal_solution_status == 2  # kSolutionStatusFeasible
            return ((pulp.LpStatusOptimal, pulp.LpSolutionIntegerFeasible) if feasible
                    else (pulp.LpStatusNotSolved, pulp.LpSolutionNoSolutionFound))


def make_solver(max_nodes: int, warm_start: bool = False):
    """HiGHS when installed (highspy), else the CBC binary bundled with PuLP; one thread and a
    budget of branch-and-bound nodes (no time limit), so the same input gives the same plan on
    any machine under any load."""
    if _highs_available():
        return _HiGHS(msg=False, threads=1, gapRel=GAP_REL, mip_max_nodes=max_nodes)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # PuLP 3.3 announces CBC's unbundling in 4.0
        return pulp.PULP_CBC_CMD(msg=False, threads=1, warmStart=warm_start, maxNodes=max_nodes, gapRel=GAP_REL)


def _set_warm_start(part, y, a, binaries, r, extra, act, z, runs, starts, f_unit, act_unit, t_unit,
                    in_max, f_max, a_max, s2r, pp, allow_recompute) -> None:
    S, K = len(y) - 1, len(runs)
    ys = list(part.bounds)
    for s in range(S + 1):
        y[s].setInitialValue(ys[s])
    cnt = {}
    for s in range(S + 1):
        for k in range(K):
            P, L = starts[k], runs[k][1]
            cnt[s, k] = min(max(ys[s] - P, 0), L)
            if (s, k) in binaries:
                lo, hi = binaries[s, k]
                lo.setInitialValue(1 if ys[s] <= P else 0)
                hi.setInitialValue(1 if ys[s] >= P + L else 0)
                a[s, k].setInitialValue(cnt[s, k])
    load = [0.0] * pp
    for s in range(S):
        n = [cnt[s + 1, k] - cnt[s, k] for k in range(K)]
        rc = bool(part.recompute[s]) and allow_recompute
        fs = sum(x * f for x, f in zip(n, f_unit))
        ac = sum(x * q for x, q in zip(n, act_unit))
        e_val = max(0.0, fs - f_max * (0 if rc else 1))
        if allow_recompute:
            r[s].setInitialValue(1 if rc else 0)
            extra[s].setInitialValue(e_val)
            act[s].setInitialValue(max(ac - a_max * (1 if rc else 0), in_max if rc else 0.0))
        load[s2r[s]] += sum(x * t for x, t in zip(n, t_unit)) + (e_val if allow_recompute else 0.0)
    z.setInitialValue(max(load))


def ilp_unit_static(ev: Evaluator, kind, lay: Layout) -> float:
    """Bytes a unit adds to its rank whatever the schedule: parameters, gradients, optimizer
    states (``Evaluator.unit_static``), plus upper bounds of the parameter-proportional terms
    ``Evaluator.memory`` counts: the gradients a W returns before they are accumulated (at most
    the rank's parameters once) and ZeRO-0/1's reduction buffers (all of them, not only their
    excess over the activations), and under ZeRO-2/3 the padding of its flat groups (fewer than
    dp*cp elements per group, at most one group per parameter tensor, each padded element costing
    its master, Adam states, gradient buffers and, whole, its weight). So a cut the ILP accepts
    fits under the estimate too."""
    n = ev.unit_params(kind, lay)
    d = lay.dp * lay.cp
    extra = ev.precision.weight * n
    if d > 1:
        extra += ev.reduction_bytes(lay, n)[1]
    if d > 1 and lay.zero >= 2:
        extra += kind.param_tensors * (d - 1) * (MASTER_BYTES + ev.precision.adam + 8 + ev.precision.weight)
    return ev.unit_static(kind, lay) + extra


def _fixed_memory(ev: Evaluator, lay: Layout, work: float, out_max: float) -> dict:
    """Per-rank memory the boundaries do not change, at least what ``Evaluator.memory`` counts:
    a rank's stages have at most 2 crossing boundaries each, every one holding m sent tensors
    until the end of the step, plus two receive buffers."""
    d = lay.dp * lay.cp
    gather = 0.0
    if lay.zero >= 3 and d > 1:  # two buffers of the largest layer group (padded by < d elements)
        gather = 2 * (max(ev.unit_weight_bytes(k, lay) for k, _ in ev.profile.runs()) + (d - 1) * ev.precision.weight)
    p2p = (2 * lay.v * lay.m + 2) * out_max if lay.pp > 1 else 0.0
    return {"working": work, "p2p": p2p, "zero-3 gather": gather, "runtime": runtime_overhead(ev.device)}
