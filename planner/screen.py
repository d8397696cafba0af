"""Round 1 of the search (planner/search.py): a closed-form time and a memory lower bound per
layout (``_Screen``), with the schedule facts it reads: the stage-microbatches a rank holds at
once (``_inflight_of``, a content-keyed cache kept on disk where the request allows) and the
stage boundaries a rank crosses."""
from __future__ import annotations

from functools import lru_cache

from autopar.schedules import registry

from . import profile_cache
from .estimate import (
    Evaluator,
    GiB,
    Layout,
    inflight_frontier,
    max_inflight,
    runtime_overhead,
)
from .request import Candidate


def _counted(units) -> list:
    """(kind, how many units are of it) of ``units``."""
    agg: dict[int, list] = {}
    for u in units:
        agg.setdefault(id(u.kind), [u.kind, 0])[1] += 1
    return [(k, n) for k, n in agg.values()]


def _inflight(lay: Layout) -> tuple[float, float]:
    return _inflight_of(lay.schedule, lay.pp, lay.m, lay.v)


# _inflight_of's values by (schedule, pp, m, v): a cache keyed by content (they depend on the code
# alone), kept on disk between runs of the same code where the request allows (Request.disk_cache;
# profile_cache.load_table): building the schedules' frontiers is most of a large search's screen
_INFLIGHT: dict = {}
_INFLIGHT_STATE = {"loaded": False, "new": False}


def _load_inflight() -> None:
    if not _INFLIGHT_STATE["loaded"]:
        _INFLIGHT.update({k: v for k, v in profile_cache.load_table("inflight").items() if k not in _INFLIGHT})
        _INFLIGHT_STATE["loaded"] = True


@lru_cache(maxsize=65536)
def _inflight_of(schedule: str, pp: int, m: int, v: int) -> tuple[float, float]:
    """(mean over ranks of the most stage-microbatches a rank holds at once, stage 0's left
    out; the same for the heaviest rank). Exact from the schedule's in-flight frontier where
    it is steady (no build beyond warm-up); for the greedy v-half / zb-h2 orders, which are
    built per m, the bound every schedule meets: the first microbatch's F on each of a rank's
    stages before any of their backwards."""
    key = (schedule, pp, m, v)
    if key not in _INFLIGHT:
        _INFLIGHT[key] = _inflight_counts(schedule, pp, m, v)
        _INFLIGHT_STATE["new"] = True
    return _INFLIGHT[key]


def _save_inflight() -> None:
    if _INFLIGHT_STATE["new"]:
        profile_cache.store_table("inflight", _INFLIGHT)
        _INFLIGHT_STATE["new"] = False


def _inflight_counts(schedule: str, pp: int, m: int, v: int) -> tuple[float, float]:
    from autopar.schedules.registry import layout as stage_layout

    if pp == 1:
        return 0.0, 0.0  # one stage 0 holding everything: it may recompute down to the token ids
    if schedule in ("zb-auto", "v-half", "zb-h2"):
        s2r = stage_layout(schedule, pp, v)
        per = [sum(1 for s in range(1, len(s2r)) if s2r[s] == r) for r in range(pp)]
    else:
        per = max_inflight(inflight_frontier(schedule, pp, m, v))
    return sum(per) / len(per), float(max(per))


def _crossings(lay: Layout) -> float:
    return _crossings_of(lay.schedule, lay.pp, lay.v)


@lru_cache(maxsize=4096)
def _crossings_of(schedule: str, pp: int, v: int) -> float:
    """Mean over ranks of the stage boundaries a rank sends or receives across."""
    from autopar.schedules.registry import layout as stage_layout

    if pp == 1:
        return 0.0
    s2r = stage_layout(schedule, pp, v)
    n = sum(2 for s in range(len(s2r) - 1) if s2r[s] != s2r[s + 1])
    return n / pp


class _Screen:
    """Round 1: a closed-form time and a memory LOWER BOUND per rank (``screen_need``; never above
    what :meth:`Evaluator.memory` gives the heaviest rank of any partition of the layout): the
    mean over ranks of parameters, gradients and optimizer states (ZeRO-sharded, experts over
    their expert-data-parallel group), the activations in flight (the schedule's in-flight count,
    each at least the smallest amount a stage can keep: recomputing, its input), the P2P buffers
    (m sent tensors per boundary a rank crosses, each at least the smallest boundary tensor, plus
    two receive buffers), the smallest working set or the gradient-reduction buffers (ZeRO-0
    buckets, ZeRO-1 flat buffers), whichever is larger, and the runtime. Also the expected memory
    at balanced stages (mean amounts), with and without recomputation: ``screen_time`` includes
    the recomputation a layout is expected to need.

    The states and reduction buffers depend only on the family (pp, dp, cp, ep, ZeRO):
    :meth:`family_ok` rejects a whole family whose states + reduction buffers + runtime alone
    exceed the limit (every layout of it would be rejected by the per-layout bound, which adds
    non-negative terms), before its (m, schedule) layouts are enumerated. The sums over units
    are cached by what they depend on: times by (b, cp, ep, ZeRO-3 dp), states by (ZeRO, dp,
    cp, ep), activation amounts by (b, cp, ep > 1); the model-wide constants (boundary tensors,
    working sets) once."""

    def __init__(self, ev: Evaluator):
        self.ev = ev
        units = ev.units
        U = len(units)
        self.kinds = _counted(units)
        # the units with the element-wise values made again (Evaluator.remade: the search's first
        # memory feature): the bounds take the lighter form, the expected fit counts it
        self.remade = ev.remade
        self.kinds_r = _counted(self.remade.units) if self.remade is not None else self.kinds
        later = units[1:] or units[:1]
        self.later = list({id(u.kind): u.kind for u in later}.values())
        if self.remade is not None:
            self.later += list({id(u.kind): u.kind for u in (self.remade.units[1:] or self.remade.units[:1])}.values())
        self.U = U
        self.min_work = min(k.work_bytes for e in (ev, self.remade) if e is not None for k in e.profile.kinds)
        self.mean_work = sum(u.kind.work_bytes for u in units) / U
        self.bd = min(min(units[j].kind.out_bytes, units[j + 1].kind.in_bytes) for j in range(U - 1)) \
            if U > 1 else 0.0
        self.bd_mean = sum(units[j].kind.out_bytes for j in range(U - 1)) / max(1, U - 1)
        self.in_mean = sum(u.kind.in_bytes for u in units) / U
        # a parameter several units share (a tied embedding/head) is one tensor on a rank that
        # holds them all: the lower bound counts it once
        self.shared = sum((len(us) - 1) * numel for us, numel in getattr(ev.profile, "shared_params", ()))
        self.overhead = runtime_overhead(ev.device)
        self._times: dict = {}
        self._static: dict = {}
        self._acts: dict = {}
        self._fam: dict = {}

    def _time_sums(self, lay: Layout, remade: bool = False):
        key = (lay.b, lay.cp, lay.ep, lay.dp if lay.zero == 3 else 0, lay.zero == 3, remade)
        hit = self._times.get(key)
        if hit is None:
            ev = self.remade if remade else self.ev
            tf = ti = tw = 0.0
            for kind, n in (self.kinds_r if remade else self.kinds):
                f, i, w = ev.unit_times(kind, lay)
                tf, ti, tw = tf + n * f, ti + n * i, tw + n * w
            hit = self._times[key] = (tf, ti, tw)
        return hit

    def _static_sums(self, lay: Layout):
        key = (lay.zero, lay.dp, lay.cp, lay.ep)
        hit = self._static.get(key)
        if hit is None:
            ev = self.ev
            static = n_all = n_exp = 0.0
            for kind, n in self.kinds:
                static += n * ev.unit_static(kind, lay)
                n_all += n * ev.unit_params(kind, lay)
                n_exp += n * kind.expert_params / lay.ep
            static -= self.shared * ev.unit_static_per_param(lay)
            n_all -= self.shared
            hit = self._static[key] = (static, n_all, n_exp)
        return hit

    def _act_sums(self, lay: Layout):
        key = (lay.b, lay.cp, lay.ep > 1)
        hit = self._acts.get(key)
        if hit is None:
            ev = self.ev
            sc = ev.scale(lay)
            saved = sum(n * max(ev.unit_saved(kind, lay)) for kind, n in self.kinds)
            saved_r = sum(n * max(ev.unit_saved(kind, lay)) for kind, n in self.kinds_r)
            # the least one microbatch of a stage past stage 0 keeps (recomputing: its first unit's input)
            a_min = min(min(k.in_bytes * sc, *ev.unit_saved(k, lay)) for k in self.later)
            hit = self._acts[key] = (a_min, saved / self.U, saved_r / self.U)
        return hit

    def family(self, pp: int, dp: int, cp: int, ep: int, zero: int) -> tuple[float, float, float]:
        """(states per rank + runtime, reduction buffers, states per rank) of a family: its
        layouts' memory bound is at least the first two summed."""
        key = (pp, dp, cp, ep, zero)
        hit = self._fam.get(key)
        if hit is None:
            lay = Layout(pp, dp, cp, ep, "1f1b", 1, 1, 1, zero, tp=self.ev.tp)
            static, n_all, n_exp = self._static_sums(lay)
            red = self.ev.reduction_bytes(lay, n_all / pp, n_exp / pp)[1]
            hit = self._fam[key] = (static / pp + self.overhead, red, static / pp)
        return hit

    def family_ok(self, pp: int, dp: int, cp: int, ep: int, zero: int) -> bool:
        base, red, _ = self.family(pp, dp, cp, ep, zero)
        return base + red <= self.ev.memory_limit

    def family_reason(self, pp: int, dp: int, cp: int, ep: int, zero: int, n: int) -> tuple[float, str]:
        base, red, states = self.family(pp, dp, cp, ep, zero)
        need = base + red
        return need, (f"OOM even perfectly balanced with every stage recomputing: needs at least {need / GiB:.1f} GiB "
                      f"per rank > {self.ev.memory_limit / GiB:.1f} GiB (lower bound: states {states / GiB:.1f}, "
                      f"reduction buffers {red / GiB:.1f}, before activations and P2P buffers; the same for all "
                      f"{n} microbatch/schedule layouts of pp={pp} dp={dp} cp={cp} ep={ep} zero={zero})")

    def __call__(self, lay: Layout) -> Candidate:
        ev = self.ev
        tf, ti, tw = self._time_sums(lay)
        a_min, saved_u, saved_r = self._act_sums(lay)
        base, red, states = self.family(lay.pp, lay.dp, lay.cp, lay.ep, lay.zero)
        sc = ev.scale(lay)
        p = lay.pp
        f, i, w = tf / p, ti / p, tw / p
        t = lay.m * (f + i + w) + registry.screen_bubble(lay.schedule, p, lay.v, f, i, w)
        # no schedule beats one microbatch's critical path: every stage's F, then every stage's I
        t = max(t, tf + ti + w / lay.v)
        c = Candidate(lay, "screened", screen_time=t)
        inflight, inflight_max = _inflight_of(lay.schedule, p, lay.m, lay.v)
        cross = _crossings_of(lay.schedule, p, lay.v)
        bd = self.bd * sc
        # sends are held until a later message from their receiver proves they arrived
        # (Evaluator.p2p_bytes): at least one per crossing, at most the microbatches in flight + 1
        p2p_min = cross * bd + (2 * bd if cross else 0.0)
        need = base + p2p_min + max(inflight * a_min + self.min_work * sc, red)
        c.screen_need = need
        if need > ev.memory_limit:
            c.status = "rejected"
            c.reason = (f"OOM even perfectly balanced with every stage recomputing: needs at least "
                        f"{need / GiB:.1f} GiB per rank > {ev.memory_limit / GiB:.1f} GiB (lower bound: states "
                        f"{states / GiB:.1f}, P2P {p2p_min / GiB:.1f}, activations {inflight * a_min / GiB:.1f}, "
                        f"reduction buffers {red / GiB:.1f})")
            return c
        # expected at balanced stages: mean per-stage amounts and boundary tensors
        per_stage = self.U / lay.num_stages
        bd_mean = self.bd_mean * sc
        held = min(lay.m, inflight_max + 1)
        p2p = cross * (held * bd_mean) + (2 * bd_mean if cross else 0.0)
        mean_work = self.mean_work * sc
        plain = base + p2p + max(inflight * saved_u * per_stage + mean_work, red)
        again = base + p2p + max(inflight * saved_r * per_stage + mean_work, red)
        rc = base + p2p + max(inflight * self.in_mean * sc + mean_work, red)
        c.screen_tier = 0 if again <= ev.memory_limit else (1 if rc <= ev.memory_limit else 2)
        if c.screen_tier:  # expected to recompute: I replays F
            c.screen_time = t + lay.m * f
        elif plain > ev.memory_limit:  # expected to make element-wise values again: I and W do more
            ti_r, tw_r = self._time_sums(lay, remade=True)[1:]
            c.screen_time = t + lay.m * max(0.0, ti_r + tw_r - ti - tw) / p
        return c
