"""The planner's search: every (pp, dp, cp, ep, schedule, microbatches, ZeRO) layout the world
size and the batch allow, priced in three rounds of increasing cost:

1. **screen** every layout with a closed-form estimate (balanced ranks, the schedule's bubble
   formula) and reject the ones that cannot fit even perfectly balanced, or break a schedule
   constraint (the reason is kept);
2. **simulate** the most promising (all of them with ``exhaustive``): balanced stage
   boundaries, the simulator's makespan and per-rank activation peak; a layout that does not fit
   is retried with every stage recomputing;
3. **solve** the stage-boundary ILP (:mod:`.ilp`) for the best simulated layouts: boundaries and
   per-stage recompute under the memory limit; the ILP's boundaries are kept only when the
   simulator agrees they are faster.

The chosen plan is the fastest feasible candidate of round 2/3, so no listed feasible
candidate is predicted faster; its predicted time is the simulator's makespan plus the
data-parallel and optimizer terms (:class:`.estimate.Estimate`).
"""
from __future__ import annotations

import math
import time
from functools import lru_cache
from typing import Callable

from autopar.schedules import registry

from .estimate import (
    Evaluator,
    GiB,
    Layout,
    Partition,
    divisors,
    normal_offload,
)
from .ilp import ILPResult, solve_partition
from .profile import ModelProfile
from .request import Candidate, PlanResult, Request, _order
from .screen import _load_inflight, _save_inflight, _Screen
from .tp_share import TP_DEGREES

# ---------------------------------------------------------------------------------------------
# partitions


def balanced_partition(times: list[float], S: int) -> tuple[int, ...]:
    """Contiguous split of ``times`` into S non-empty stages minimizing the largest stage sum."""
    U = len(times)
    if S > U:
        raise ValueError(f"{S} stages but only {U} units")
    prefix = [0.0]
    for t in times:
        prefix.append(prefix[-1] + t)

    def cuts_for(limit: float):
        bounds, start = [0], 0
        for s in range(S - 1):
            remaining = S - 1 - s  # stages still to place after this one
            end = start + 1
            while end < U - remaining and prefix[end + 1] - prefix[start] <= limit:
                end += 1
            bounds.append(end)
            start = end
        bounds.append(U)
        ok = all(prefix[bounds[i + 1]] - prefix[bounds[i]] <= limit * (1 + 1e-12) for i in range(S))
        return tuple(bounds), ok

    lo, hi = max(times), prefix[-1]
    best = cuts_for(hi)[0]
    for _ in range(60):
        mid = (lo + hi) / 2
        b, ok = cuts_for(mid)
        if ok:
            hi, best = mid, b
        else:
            lo = mid
        if hi - lo <= 1e-9 * hi:
            break
    return best


# ---------------------------------------------------------------------------------------------
# search

def layouts(profile: ModelProfile, req: Request, reject: Callable[[Layout, str], None],
            family: Callable[[int, int, int, int, int, int], bool] | None = None,
            pruned: Callable[[list, int], None] | None = None, max_tp: int = 8):
    """Every layout the world size, batch and model allow (violations go to ``reject``); tp
    over the degrees up to ``max_tp`` (the GPUs of a node) where the model has something the
    tensor-parallel pass shards (``ModelProfile.shards_at``), and cp then divides the heads a
    tp rank holds.

    ``family(pp, dp, cp, ep, zero, tp)``: False skips every (microbatches, schedule) layout of that
    family without checking them one by one (the search's family memory bound); ``pruned(lay,
    n)`` then gets the family's first layout that passes the schedule constraints (None if none
    does) and ``n``, its (m, schedule) combinations matching the pin (constraints unchecked)."""
    N, U = req.gpus, len(profile.units)
    seq = profile.seq_len or 1
    pin = dict(req.pin)
    fam_pin = {k: x for k, x in pin.items() if k in ("pp", "dp", "cp", "ep", "zero", "tp")}
    if "tp" in pin:  # a pinned degree is priced whatever shards_at says
        tps = [pin["tp"]] if N % pin["tp"] == 0 else []
    else:
        tps = [1] + [t for t in TP_DEGREES if req.allow_tp and t <= max_tp and N % t == 0 and profile.shards_at(t)]
    for tp, pp in ((tp, pp) for tp in tps for pp in divisors(N // tp)):
        if pp > U:
            continue
        for cp in divisors(N // (pp * tp)):
            if cp > 1 and (not req.allow_cp or cp > req.max_cp or seq % cp or (
                    req.cp_blocker(cp) is not None if req.cp_blocker is not None
                    else not profile.n_heads or profile.n_heads % cp) or (profile.n_heads % (cp * tp) if tp > 1
                                                                          else False)):
                continue
            dp = N // (pp * cp * tp)
            if req.global_batch % dp:
                continue
            per_replica = req.global_batch // dp
            eps = [1]
            if profile.n_experts and req.allow_ep:
                # experts folded over the tp ranks (autopar.plan.expert_slots): ep up to dp*cp*tp;
                # a static-capacity MoE cannot fold, so with tp > 1 it keeps ep = 1
                eps = [e for e in divisors(dp * cp * tp) if profile.n_experts % e == 0] \
                    if tp == 1 or profile.foldable else [1]
            zeros = [z for z in req.zero_levels if z == 0 or dp * cp > 1]
            ms = [m for m in divisors(per_replica) if m <= req.max_microbatches]
            names = ("1f1b",) if pp == 1 else req.schedules
            for ep in eps:
                for z in zeros:
                    fam = {"pp": pp, "dp": dp, "cp": cp, "ep": ep, "zero": z, "tp": tp}
                    if fam_pin and any(fam[k] != x for k, x in fam_pin.items()):
                        continue
                    if family is not None and not family(pp, dp, cp, ep, z, tp):
                        if pruned is not None:
                            combos = [(m, name) for m in ms for name in names
                                      if _fits_pin(pin, pp, m, per_replica // m, name, U)]
                            pruned(_first_valid(combos, pp, dp, cp, ep, z, per_replica, tp, pin), len(combos))
                        continue
                    for m in ms:
                        b = per_replica // m
                        for name, v in ((name, v) for name in names for v in _stages_per_rank(name, pp, pin, m)):
                            if pp * v > U:
                                continue
                            lay = Layout(pp, dp, cp, ep, name, v, m, b, z, tp=tp)
                            if pin and any(getattr(lay, k) != x for k, x in pin.items()):
                                continue
                            why = _constraint(name, pp, m, v)
                            if why is not None:
                                reject(lay, why)
                                continue
                            if name == "zb-auto" and pp * m > req.zb_auto_max:
                                reject(lay, f"zb-auto is searched only where pp*m <= {req.zb_auto_max} (its greedy "
                                            f"search grows faster than pp*m); zb-h2 and zbv cover larger pipelines")
                                continue
                            if name in ("zb-h2", "v-half") and pp * m > req.greedy_max and "schedule" not in pin:
                                reject(lay, f"{name} is searched only where pp*m <= {req.greedy_max} (its order is a "
                                            f"greedy search per (pp, m), superlinear in pp*m); zbv, v-min and zb-h1 "
                                            f"cover larger pipelines (pin schedule={name} to price it anyway)")
                                continue
                            yield lay


@lru_cache(maxsize=None)
def _constraint(name: str, pp: int, m: int, v: int) -> str | None:
    """Why the schedule does not take (pp, m, v), or None (registry.check, memoized: the same
    combinations recur in every (dp, cp, ep, ZeRO, tp) family)."""
    try:
        registry.check(name, pp, m, v)
    except ValueError as e:
        return str(e)
    return None


# the stages per rank interleaved-1f1b is searched with where the V schedules cannot run (fewer
# than 2 pp microbatches): more stages, a smaller bubble ((pp-1)/(v m) of the step) for more P2P
# transfers and, on the first rank, a few more microbatches in flight; with more microbatches
# zbv and dualpipev leave less bubble than any of them, and interleaved-1f1b is searched at 2
INTERLEAVED_STAGES = (2, 4, 8)


def _stages_per_rank(name: str, pp: int, pin: dict, m: int = 0) -> tuple[int, ...]:
    """The schedule's stages per rank to search at ``m`` microbatches (``--pin v=`` where given:
    interleaved-1f1b takes any; the schedule's constraints reject the rest), 1 without a pipeline."""
    if pp == 1:
        return (1,)
    if "v" in pin:
        return (pin["v"],)
    if name == "interleaved-1f1b" and m < 2 * pp:
        return INTERLEAVED_STAGES
    return (registry.default_stages_per_rank(name),)


def _fits_pin(pin: dict, pp: int, m: int, b: int, name: str, U: int) -> bool:
    return any(pp * v <= U and all(got[k] == x for k, x in pin.items() if k in got)
               for v in _stages_per_rank(name, pp, pin, m) for got in ({"schedule": name, "v": v, "m": m, "b": b},))


def _first_valid(combos, pp, dp, cp, ep, z, per_replica, tp: int = 1, pin: dict | None = None) -> Layout | None:
    for m, name in combos:
        for v in _stages_per_rank(name, pp, pin or {}, m):
            if _constraint(name, pp, m, v) is None:
                return Layout(pp, dp, cp, ep, name, v, m, per_replica // m, z, tp=tp)
    return None


def plan(profile: ModelProfile, device, req: Request, progress: Callable[[str], None] | None = None) -> PlanResult:
    say = progress or (lambda msg: None)
    if req.disk_cache:
        _load_inflight()
    t0 = time.perf_counter()
    ev = Evaluator(profile, device, req.memory_limit, req.global_batch, moe_imbalance=req.moe_imbalance,
                   loss_chunking=req.loss_chunking, offloading=req.offloading, optimizer=req.optimizer)
    cands: list[Candidate] = []
    rejected: list[Candidate] = []
    rejected_seen = set()
    n_constraint = [0]

    def reject(lay: Layout, why: str) -> None:
        n_constraint[0] += 1
        key = (lay.schedule, why)
        if key not in rejected_seen:  # one example per distinct reason is enough for the report
            rejected_seen.add(key)
            rejected.append(Candidate(lay, "rejected", why))

    # round 1: screen (whole families whose states alone cannot fit first, then layout by layout);
    # one screen per tp degree, over the model as one rank of its tp group sees it
    screens: dict[int, _Screen] = {}

    def screen(tp: int) -> _Screen:
        if tp not in screens:
            screens[tp] = _Screen(ev.for_tp(tp))
        return screens[tp]

    n_family = [0, 0]  # families, layouts

    def pruned(lay: Layout | None, n: int) -> None:
        n_family[0] += 1
        n_family[1] += n
        if lay is not None:  # one layout stands for the family (the report, the closest plan)
            need, why = screen(lay.tp).family_reason(lay.pp, lay.dp, lay.cp, lay.ep, lay.zero, n)
            cands.append(Candidate(lay, "rejected", why, screen_need=need))

    def family_ok(pp: int, dp: int, cp: int, ep: int, zero: int, tp: int) -> bool:
        return screen(tp).family_ok(pp, dp, cp, ep, zero)

    max_tp = min(TP_DEGREES[-1], getattr(device, "gpus_per_node", TP_DEGREES[-1]))
    for lay in layouts(profile, req, reject, family=family_ok, pruned=pruned, max_tp=max_tp):
        cands.append(screen(lay.tp)(lay))
    say("searched " + searched_axes([c.layout for c in cands + rejected]))
    screened = [c for c in cands if c.status != "rejected"]
    tiers = [sum(1 for c in screened if c.screen_tier == t) for t in range(3)]
    n_mem = len(cands) - len(screened) - n_family[0]
    say(f"screened {n_mem + len(screened) + n_constraint[0] + n_family[1]} layouts: {n_family[1]} in "
        f"{n_family[0]} (pp, dp, cp, ep, ZeRO) families whose states + reduction buffers + runtime alone exceed "
        f"{req.memory_limit / GiB:.1f} GiB (schedule constraints not checked), {n_constraint[0]} break a "
        f"schedule constraint, {n_mem} cannot fit (memory lower bound: states + P2P buffers + activations in "
        f"flight + reduction buffers + runtime > {req.memory_limit / GiB:.1f} GiB), {len(screened)} may fit "
        f"({tiers[0]} expected to fit, {tiers[1]} only recomputing, {tiers[2]} expected over the limit: "
        f"searched last)")
    # likely-fitting, fast ones first: expected over the limit last, then by the step time
    # including the recomputation a layout is expected to need
    screened.sort(key=lambda c: (c.screen_tier == 2, c.screen_time, c.layout.pp, c.layout.cp, c.layout.zero,
                                 c.layout.schedule, c.layout.m))

    # round 2: simulate
    # default mode: in screen order, until top_simulate layouts or the action budget is spent, or
    # the screen estimate falls 25% behind the best simulated step (the screen is not a bound:
    # these stopping rules are what --all removes)
    t_sim = time.perf_counter()
    todo: list[Candidate] = []
    spent = n_timed = checked = 0
    best = math.inf
    out_of_work = False
    for c in screened:
        if not req.exhaustive and todo:
            if n_timed >= req.top_simulate:
                break
            if spent >= req.simulate_actions and best < math.inf:
                out_of_work = True
                break
            if n_timed >= 8 and c.screen_time > 1.25 * best:
                break
        timed = _simulate(ev, c)
        todo.append(c)
        if len(todo) % 200 == 0:
            say(f"  priced {len(todo)} of {len(screened)} layouts")
        lay = c.layout
        if not timed:
            checked += 1
            if checked >= req.memory_checks and not req.exhaustive and best < math.inf:
                break
            continue
        n_timed += 1
        spent += simulation_work(lay) * (1 + c.variants)  # (with its memory-feature variants: _simulate)
        if c.status == "feasible":
            best = min(best, c.time)
    for c in screened[len(todo):]:
        c.status, c.reason = "screened", "not simulated: its closed-form estimate is behind the simulated ones"
    stopped = (f"; stopped at the budget of {req.simulate_actions:,} simulated actions (--all simulates every "
               "layout that passes the screen)") if out_of_work else ""
    say(f"simulated {n_timed} layouts ({checked} more found over the memory limit before timing) "
        f"in {time.perf_counter() - t_sim:.1f} s{stopped}")

    # round 3: ILP on the best simulated layouts (and on OOM ones when nothing fits)
    feas = sorted((c for c in todo if c.status == "feasible"), key=_order)
    pool = feas[: req.top_ilp]
    if not pool:
        pool = sorted((c for c in todo if c.status == "oom"), key=lambda c: c.peak)[: req.top_ilp]
    t_ilp = time.perf_counter()
    ilp_runs = _refine_all(ev, pool, req)
    solver_s = time.perf_counter() - t_ilp
    say(f"solved {len(ilp_runs)} stage-boundary ILPs in {solver_s:.2f} s (at most {req.ilp_nodes:,} "
        f"branch-and-bound nodes each: {', '.join(sorted(set(r.status for r in ilp_runs))) or 'none'})")

    feas = sorted((c for c in cands if c.status == "feasible"), key=_order)
    if not feas and not any(c.peak is not None for c in cands):
        # nothing passed the screen: simulate the least hungry layouts, to say how close they come
        for c in sorted((c for c in cands if c.status == "rejected"), key=lambda c: c.screen_need)[:5]:
            _simulate(ev, c)  # over the limit by the screen; c.peaks / c.estimate say by how much
        feas = sorted((c for c in cands if c.status == "feasible"), key=_order)  # the screen may err
    chosen = feas[0] if feas else None
    if chosen is not None:
        chosen.status, chosen.reason = "chosen", "fastest predicted step that fits"
        for c in feas[1:]:
            c.reason = f"{(c.time / chosen.time - 1) * 100:.1f}% slower ({c.time:.4g} s vs {chosen.time:.4g} s)"
    if req.disk_cache:
        _save_inflight()
    return PlanResult(chosen=chosen, candidates=cands + rejected, evaluator=ev, request=req,
                      search_s=time.perf_counter() - t0, solver_s=solver_s, ilp_runs=ilp_runs)


def searched_axes(lays) -> str:
    """The degrees and choices among ``lays``, one phrase per axis (the search's log line)."""
    def vals(field):
        return ",".join(str(x) for x in sorted({getattr(lay, field) for lay in lays}))
    names = sorted({lay.schedule for lay in lays})
    return (f"tp {vals('tp')}; pp {vals('pp')}; dp {vals('dp')}; cp {vals('cp')}; ep {vals('ep')}; "
            f"ZeRO {vals('zero')}; {len(names)} schedules ({', '.join(names)})")


# schedules whose order is searched per (pp, m) rather than generated in closed form: building
# one costs about this many simulated actions per action
GREEDY = ("zb-auto", "zb-h2", "v-half", "v-min")
GREEDY_WEIGHT = 8


def simulation_work(lay: Layout) -> int:
    """The work one simulated layout counts against ``Request.simulate_actions``: its actions
    (F, I, W per stage and microbatch), times ``GREEDY_WEIGHT`` for a searched order."""
    return 3 * lay.num_stages * lay.m * (GREEDY_WEIGHT if lay.schedule in GREEDY else 1)


def _unit_totals(ev: Evaluator, lay: Layout) -> list[float]:
    return [sum(ev.unit_times(u.kind, lay)) for u in ev.units]


def _simulate(ev: Evaluator, c: Candidate) -> bool:
    """``_simulate_one``, and where memory binds (over the limit, or fitting only by
    recomputing), the same layout with the memory features the model allows: every stage's
    backward making element-wise values again (``Evaluator.remade``, ``Plan.remake``; the others
    are priced on top of it), the loss chunked (``Evaluator.chunked``) and saved activations
    offloaded (unless the evaluator's ``offloading`` is off): the least share per stage that fits
    without recomputing (``Evaluator.least_offload``: the stages whose microbatches wait longest
    first; fixed-order schedules) where there is one, else all of every stage's saved
    activations. The strongest combination is priced first; if even it does not fit, the layout
    stays as it was priced; else every combination is priced and the fastest that fits is kept
    (``_lighter``; ``remake``, ``loss_chunk`` and ``offload`` say which). The features only add
    work (element-wise ops made again, a recomputed head GEMM, copies), so where memory does not
    bind none is used. Each variant priced counts against the search's budget of simulated
    actions as one more simulation of the layout (``Candidate.variants``)."""
    ev = ev.for_tp(c.layout.tp)
    timed = _simulate_one(ev, c)
    if not _binds(c):
        return timed
    base = ev.remade or ev
    chunked = base.chunked
    evs = (base, chunked) if chunked is not None else (base,)
    variants = [(e, 0.0) for e in evs if e is not ev]
    if ev.offloading:
        for e in evs:  # the least shares where some fit (more only adds copies), else everything
            least = _least_offload(e, c.layout)
            if least is None:
                variants.append((e, 1.0))
            elif least != 0.0:
                variants.append((e, least))
    if not variants:
        return timed
    # strongest first: least memory
    order = sorted(variants, key=lambda v: (v[0] is base, v[1] != 1.0))
    best, best_timed = None, timed
    for k, (e, f) in enumerate(order):
        other = Candidate(c.layout, "screened", loss_chunk=e.profile.loss_chunk_tokens, offload=f,
                          remake=base is not ev)
        t = _simulate_one(e, other)
        c.variants += 1
        if other.status == "feasible" and (best is None or _lighter(other) < _lighter(best)):
            best, best_timed = other, t
        if k == 0 and other.status != "feasible":
            if c.status != "feasible" and other.peak is not None and (c.peak is None or other.peak < c.peak):
                best, best_timed = other, t  # closer to fitting: what the report shows
            break
    if best is not None and (best.status != "feasible" or c.status != "feasible" or best.time < c.time):
        c.status, c.reason, c.estimate, c.peaks = best.status, best.reason, best.estimate, best.peaks
        c.loss_chunk, c.offload, c.remake = best.loss_chunk, best.offload, best.remake
        return best_timed
    return timed


def _lighter(c: Candidate) -> tuple:
    """How ``_simulate`` ranks the variants that fit: the fastest, then (a tie where the copies
    hide behind compute) the fewest bytes offloaded, then the loss as captured, then the
    element-wise values kept."""
    shares = c.offload if isinstance(c.offload, tuple) else (c.offload,) * c.layout.num_stages
    return c.time, sum(shares), c.loss_chunk != 0, c.remake


def _least_offload(ev: Evaluator, lay: Layout):
    """``Evaluator.least_offload`` at the balanced boundaries ``_simulate_one`` prices, without
    recomputation (normalized: one number when every stage has the same share)."""
    S = lay.num_stages
    bounds = balanced_partition(_unit_totals(ev, lay), S)
    least = ev.least_offload(lay, Partition(bounds, (False,) * S))
    return None if least is None else normal_offload(least)


def _binds(c: Candidate) -> bool:
    return c.status == "oom" or (c.estimate is not None and any(c.estimate.partition.recompute))


def evaluator_of(ev: Evaluator, c: Candidate) -> Evaluator:
    """The Evaluator that priced ``c``: its tp degree's (``Evaluator.for_tp``), the remaking one
    when ``c.remake``, the chunked-loss one of that when ``c.loss_chunk``."""
    ev = ev.for_tp(c.layout.tp)
    ev = ev.remade if c.remake else ev
    return ev.chunked if c.loss_chunk else ev


def _simulate_one(ev: Evaluator, c: Candidate) -> bool:
    """Balanced boundaries, recomputing everywhere if that is what fits; returns False when the
    layout was found over the memory limit without timing it (fixed-order schedules)."""
    lay = c.priced_layout
    S = lay.num_stages
    bounds = balanced_partition(_unit_totals(ev, lay), S)
    plain, everywhere = Partition(bounds, (False,) * S), Partition(bounds, (True,) * S)
    # a floor no order beats, one microbatch in flight on every stage (for zb-auto, whose order
    # is only known after its search; for the others, before their schedule is built)
    floor = {True: _floor(ev, lay, everywhere)}
    fits = {True: max(floor[True]) <= ev.memory_limit}
    if lay.schedule == "zb-auto" or not fits[True]:  # (a fixed order needs no plain floor when that one fits)
        floor[False] = _floor(ev, lay, plain)
        fits[False] = max(floor[False]) <= ev.memory_limit
    if not any(fits.values()):
        peaks = min(floor.values(), key=max)
        c.peaks = tuple(peaks)
        r = max(range(len(peaks)), key=peaks.__getitem__)
        c.status, c.reason = "oom", (f"OOM on rank {r} by at least {(peaks[r] - ev.memory_limit) / GiB:.2f} GiB "
                                     f"(floor: one microbatch in flight per stage, recomputing or not)")
        return False
    if lay.schedule != "zb-auto":  # fixed orders: memory is known without timing the schedule
        part = plain
        peaks = ev.peak_memory_only(lay, plain)
        if max(peaks) > ev.memory_limit:
            part = everywhere
            peaks = min(peaks, ev.peak_memory_only(lay, everywhere), key=max)
        if max(peaks) > ev.memory_limit:
            c.peaks = tuple(peaks)
            r = max(range(len(peaks)), key=peaks.__getitem__)
            c.status, c.reason = "oom", f"OOM on rank {r} by {(peaks[r] - ev.memory_limit) / GiB:.2f} GiB"
            return False
        c.estimate = ev.evaluate(lay, part)
    else:
        # zb-auto: a partition whose floor is over the limit is not searched
        est = ev.evaluate(lay, plain) if fits[False] else None
        if (est is None or not est.feasible) and fits[True]:
            est2 = ev.evaluate(lay, everywhere)
            if est is None or est2.feasible or max(est2.peak_memory) < max(est.peak_memory):
                est = est2
        c.estimate = est
    _classify(c)
    return True


def _floor(ev: Evaluator, lay: Layout, part: Partition) -> list[float]:
    """Per-rank memory below which no schedule order of ``lay`` at ``part`` goes: every stage
    holds at least one microbatch's saved activations after its first F (everything else a
    rank holds does not depend on the order). With two stages per rank the V or the
    interleaved layout (zb-auto may return either: the smaller floor of the two), or the fixed
    schedule's own."""
    from autopar.schedules.ir import linear_layout, v_layout
    from autopar.schedules.registry import layout as stage_layout

    after_f, _ = ev.stage_amounts(lay, part)
    best = None
    if lay.v == 1:
        layouts = [linear_layout(lay.pp, 1)]
    elif lay.schedule == "zb-auto":
        layouts = [v_layout(lay.pp), linear_layout(lay.pp, lay.v)]
    else:  # a fixed order has its own
        layouts = [stage_layout(lay.schedule, lay.pp, lay.v)]
    for s2r in layouts:
        acts = [max((after_f[s] for s in range(len(s2r)) if s2r[s] == r), default=0.0) for r in range(lay.pp)]
        tot = ev.memory(lay, part, s2r, acts, split_moe=False)[1]
        if best is None or max(tot) < max(best):
            best = tot
    return best


def _classify(c: Candidate) -> None:
    est = c.estimate
    if est.feasible:
        c.status, c.reason = "feasible", ""
    else:
        r, over = est.oom()
        c.status, c.reason = "oom", f"OOM on rank {r} by {over / GiB:.2f} GiB"


def _ilp_input(ev: Evaluator, c: Candidate) -> tuple:
    """(evaluator, layout, schedule, I-free fraction) of the stage-boundary ILP of ``c``."""
    ev = evaluator_of(ev, c)
    lay = c.priced_layout
    if c.estimate is None:  # found OOM before timing: price it now, the ILP starts from it
        S = lay.num_stages
        c.estimate = ev.evaluate(lay, Partition(balanced_partition(_unit_totals(ev, lay), S), (True,) * S))
    sched = c.estimate.schedule_obj
    if lay.schedule == "zb-auto":  # its order depends on the boundaries: plan memory with zb-h1's
        try:
            sched = registry.build("zb-h1", lay.pp, lay.m, lay.v)
        except ValueError:
            pass  # zb-h1 does not take this (pp, m, v): keep the zb-auto order just priced
    return ev, lay, sched, ev.i_free_fraction(c.estimate.partition)


def _adopt(ev: Evaluator, c: Candidate, res: ILPResult) -> ILPResult:
    """Keep the ILP's boundaries where they fit and beat the candidate's."""
    c.ilp = res
    if res.partition is not None:
        est = evaluator_of(ev, c).evaluate(c.priced_layout, res.partition)
        if est.feasible and (not c.estimate.feasible or est.step_time < c.estimate.step_time):
            c.estimate = est
            _classify(c)
    return res


def _refine(ev: Evaluator, c: Candidate, req: Request) -> ILPResult:
    e, lay, sched, frac = _ilp_input(ev, c)
    return _adopt(ev, c, solve_partition(e, lay, sched, frac, max_nodes=req.ilp_nodes, warm=c.estimate.partition))


def _refine_all(ev: Evaluator, pool: list[Candidate], req: Request) -> list[ILPResult]:
    """``_refine`` every candidate of ``pool``, their solves at once: CBC runs each in a process of
    its own (one thread, a node budget), so on a multi-core machine the solves overlap; the
    inputs and the adoption stay in order here, so the answer is the same as one by one."""
    from concurrent.futures import ThreadPoolExecutor

    inputs = [_ilp_input(ev, c) for c in pool]
    with ThreadPoolExecutor(max_workers=max(1, len(pool))) as pool_:
        futures = [pool_.submit(solve_partition, *x, max_nodes=req.ilp_nodes, warm=c.estimate.partition)
                   for c, x in zip(pool, inputs)]
        results = [f.result() for f in futures]
    return [_adopt(ev, c, r) for c, r in zip(pool, results)]


def price(ev: Evaluator, lay: Layout, req: Request | None = None, refine: bool = True) -> Candidate:
    """Price one layout as the search would (balanced boundaries, recompute if needed, then
    the ILP when ``refine``): for benchmarks that compare a chosen layout with a measurement."""
    req = req or Request(gpus=lay.world, global_batch=ev.global_batch, memory_limit=ev.memory_limit)
    registry.check(lay.schedule, lay.pp, lay.m, lay.v)
    c = Candidate(lay, "screened")
    _simulate(ev, c)
    if refine and lay.num_stages > 1:
        _refine(ev, c, req)
    return c


def to_plan(res_or_ev, cand: Candidate):
    """The runtime's ``autopar.Plan`` for a candidate whose units map to captured-graph cuts."""
    from autopar.plan import Plan

    ev = res_or_ev.evaluator if isinstance(res_or_ev, PlanResult) else res_or_ev
    est, lay = cand.estimate, cand.layout
    units = ev.units
    cuts = [units[b].cut for b in est.partition.bounds[1:-1]]
    if any(c is None for c in cuts):
        raise ValueError("this profile's units do not map to graph positions (a preset built at reduced depth); "
                         "plan the full model to run it")
    return Plan(pp=lay.pp, dp=lay.dp, cp=lay.cp, ep=lay.ep, tp=lay.tp, sequence_parallel=lay.sequence_parallel,
                schedule=lay.schedule,
                num_microbatches=lay.m,
                stages_per_rank=lay.v, stage_cuts=tuple(cuts),
                recompute=tuple(i for i, r in enumerate(est.partition.recompute) if r), zero=lay.zero,
                moe_imbalance=plan_moe_imbalance(ev, lay), loss_chunk_tokens=cand.loss_chunk, offload=cand.offload,
                compile=ev.profile.compiled, remake=True if cand.remake else None)


def plan_moe_imbalance(ev: Evaluator, lay: Layout) -> float | None:
    """The receive imbalance a plan is priced at (``Plan.moe_imbalance``): the imbalance the evaluator
    priced the worst rank's receive at, when the model has dropless (token-proportional) MoE
    blocks and ep > 1; None otherwise (no dispatch across ranks, or static-capacity buffers)."""
    if lay.ep > 1 and any(u.kind.routed is not None for u in ev.units):
        return ev.moe_imbalance
    return None
