"""Predicted step time and per-rank memory of one candidate plan (degrees + schedule +
microbatching + stage boundaries + recompute), from a ModelProfile and a DeviceProfile.

Time: each stage's F, I and W are the sums of its units' times (roofline per node); CP adds the
Ulysses all-to-alls around each attention to F and I, EP the token dispatch/combine around each
MoE, ZeRO-3 the parameter all-gather of every F and I, overlapped with the unit's compute (a
unit takes the longer of the two; on the cpu profile, where gloo shares the cores, the sum).
The schedule is replayed by the simulator with these per-stage costs and the P2P transfer
time of each stage boundary. Per stage the runtime adds: stage 0's I is empty (its W does the
whole backward), every W/B accumulates its gradients into ``.grad`` (a linear layer's inside
its weight-gradient GEMM), and on the cpu profile every cross-rank message costs the rank
compute time. After the pipeline, in the runtime's order (:meth:`Evaluator.after_pipeline`):
tied weights summed over the pipeline ranks holding them, the data-parallel reduction
(ZeRO-0: started when a stage's last W/B ran, overlapped only with the rank's later actions;
ZeRO-1: reduce-scatter and all-gather inside the optimizer step, not overlapped; ZeRO-2/3: one
reduce-scatter per layer group after its last W, ZeRO-2's all-gather after the step), then the
optimizer step (memory-bound, torch's Adam passes). ``step = makespan + dp_exposed +
optimizer``. On the ``cpu`` profile units are priced from their measured programs
(``UnitKind.times``) and gloo's collectives, P2P under load and shared memory bandwidth use the
measured constants below.

Memory, per rank, the heaviest rank decides:
  parameters, gradients and optimizer states (sharded over dp*cp by the ZeRO level; ZeRO-2/3
  exactly as ``autopar.parallel.zero_layout`` lays them out, padding, resident group and gather
  buffers included; expert weights split over ep and never ZeRO-sharded; a parameter several
  units share, e.g. a tied embedding/head, once per rank), the saved activations at the
  schedule's peak (walking each rank's actions in order: F adds what the stage saves, I
  changes it to what W still needs, which includes the values I computes for W and can be MORE
  than F saved, W frees the rest, B frees all), the largest transient working set of one unit,
  under ZeRO-2/3 the fresh gradients one W/B returns before they are added into the flat
  buffers (ZeRO-0/1 programs accumulate into ``.grad`` in place and return none), P2P buffers
  (the runtime keeps every sent tensor until the end of the step: m per boundary and direction,
  plus two receive buffers in flight), the gradient-reduction buffers (DP buckets, ZeRO-1's
  flat gradients and gathered parameters; the runtime allocates them after a stage's last
  backward, so only their excess over the pipeline phase's activations and transients counts),
  and a fixed runtime overhead.
Rank layout: cp varies fastest, then dp, then pp (so cp and dp groups stay inside a node when
they can); ep groups are drawn from the dp*cp ranks of one stage.
"""
from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field, replace
from functools import lru_cache

from autopar.parallel.zero_layout import (
    MASTER_BYTES,
    ParamSpec,
    ZeroLayout,
    aligned_offsets,
    layer_group,
    ns_flops,
    zero_layout,
)
from autopar.schedules import build, simulate
from autopar.schedules.costs import Costs
from autopar.schedules.ir import F as _F
from autopar.schedules.ir import I as _I
from autopar.schedules.ir import W as _W
from autopar.schedules.simulate import peak_memory

from . import comm
from .profile import ModelProfile, UnitKind

GiB = 1024 ** 3

# gloo collectives between 2 processes on the cpu profile's machine reach only a fraction of
# the link bandwidth of the cpu profile (point-to-point: ~2.5 GB/s, close to it): measured by
# ``python benchmarks/cost_model.py --gloo`` on the 2-core CI VM (2 ranks, 1-13 MB buffers,
# median of 13), effective ring bandwidth / 2 GB/s: all_reduce 0.94 GB/s, all_gather_into_tensor
# 0.59 GB/s (of the full output), reduce_scatter_tensor 0.30 GB/s (of the full input). Gloo
# has no native reduce-scatter / all-gather into one tensor; PyTorch emulates them with extra
# copies. Used only for the cpu device (``Evaluator.collective``).
GLOO_EFFICIENCY = {"all_reduce": 0.47, "all_gather": 0.30, "reduce_scatter": 0.15}
# The cpu profile measures streaming bandwidth with one process; two processes streaming at
# once each get less (shared memory controller and last-level cache). Measured on the 2-core
# CI VM with ``autopar.planner.devices.measure_cpu`` (64 MiB copy/add, one thread) run alone,
# 13.6-14.9 GB/s, and in two processes at once, 9.0-12.5 GB/s each (median ratio 0.72).
CPU_SHARED_BANDWIDTH = 0.72
# P2P between gloo processes whose cores are busy computing (the pipeline's normal state): the
# cpu profile's link (alpha 50 us, 2 GB/s) is what an idle pair sees (ping-pong of 64 KB: 0.1 ms).
# With both ranks computing, gloo's I/O threads have to be scheduled on the busy cores: measured
# by ``python benchmarks/cost_model.py --gloo`` ("p2p under load": both ranks run 10 ms matmul
# chunks and exchange one 32-256 KB message per chunk, waiting for it at once or 4 chunks
# later), every message costs the sending and the receiving rank 0.5-1.5 ms of compute time, and
# a message waited for at once arrives 0.5-2.5 ms late. The per-step breakdown of
# ``cost_model.py --actions`` agrees: outside F/I/W/B, receive waits and the optimizer, a pp=2
# rank spends ~1.5 ms per microbatch (one message out, one in). Used only for the cpu device.
CPU_P2P_MESSAGE_S = 0.75e-3
CPU_P2P_LATENCY_S = 1.0e-3

# Default max/mean ratio of the rows an expert-parallel rank receives in a dropless MoE
# dispatch: the capacity factor 1.25 that Switch Transformers (Fedus et al. 2021,
# arXiv:2101.03961, section 2.2 and Table 1) and GShard (Lepikhin et al. 2020,
# arXiv:2006.16668) train with as headroom for routing imbalance; ``--moe-imbalance`` sets it.
DEFAULT_MOE_IMBALANCE = 1.25

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


def normal_offload(offload) -> float | tuple[float, ...]:
    """An offload share in its one spelling: a number when every stage has the same (0.0 when
    none is offloaded), else a tuple with one share per stage."""
    if isinstance(offload, (tuple, list)):
        shares = tuple(float(f) for f in offload)
        return shares if len(set(shares)) > 1 else (shares[0] if shares else 0.0)
    return float(offload)


def offload_label(offload) -> str:
    """``0.5`` or ``(1, 0.42, 0)``: how reports and labels print a (normal) offload share."""
    if isinstance(offload, tuple):
        return "(" + ", ".join(f"{f:.3g}" for f in offload) + ")"
    return f"{offload:g}"


@dataclass(frozen=True)
class Layout:
    """The discrete choices of a plan (everything but boundaries and recompute)."""

    pp: int
    dp: int
    cp: int
    ep: int
    schedule: str
    v: int            # stages per rank
    m: int            # microbatches per step (per dp replica)
    b: int            # samples per microbatch
    zero: int
    # share of each stage's saved activations parked on the host between F and I/W: one number
    # for every stage, or a tuple with one per stage (``offload_shares``)
    offload: float | tuple[float, ...] = 0.0

    def __post_init__(self):
        object.__setattr__(self, "offload", normal_offload(self.offload))

    @property
    def num_stages(self) -> int:
        return self.pp * self.v

    def offload_of(self, stage: int) -> float:
        """The share of ``stage``'s saved activations parked on the host."""
        return self.offload[stage] if isinstance(self.offload, tuple) else self.offload

    @property
    def world(self) -> int:
        return self.pp * self.dp * self.cp

    def label(self) -> str:
        return (f"pp={self.pp} dp={self.dp} cp={self.cp} ep={self.ep} {self.schedule} v={self.v} "
                f"m={self.m} b={self.b} zero={self.zero}"
                + (f" offload={offload_label(self.offload)}" if self.offload else ""))


@dataclass(frozen=True)
class Partition:
    bounds: tuple[int, ...]        # S+1 unit indices: stage s holds units bounds[s]:bounds[s+1]
    recompute: tuple[bool, ...]    # per stage


@dataclass
class Estimate:
    layout: Layout
    partition: Partition
    stage_to_rank: tuple[int, ...]
    stage_costs: Costs
    makespan_s: float
    dp_exposed_s: float
    optimizer_s: float
    bubble: float
    peak_memory: tuple[float, ...]                    # bytes per pp rank
    memory: tuple[dict, ...]                          # per pp rank: component -> bytes
    memory_limit: float
    tokens_per_s: float = 0.0
    mfu: float = 0.0
    message_bytes: tuple[float, ...] = ()
    p2p_link: tuple[float, float] = (0.0, 1.0)        # (alpha, bandwidth)
    schedule_obj: object = field(default=None, repr=False)
    # activation offload (Layout.offload), per pp rank: the most bytes parked on the host at once,
    # and the copy time compute does not hide, summed over the step's actions
    host_bytes: tuple[float, ...] = ()
    offload_exposed_s: tuple[float, ...] = ()

    @property
    def step_time(self) -> float:
        return self.makespan_s + self.dp_exposed_s + self.optimizer_s

    @property
    def feasible(self) -> bool:
        return max(self.peak_memory) <= self.memory_limit

    def oom(self) -> tuple[int, float]:
        """(worst rank, bytes over the limit)."""
        r = max(range(len(self.peak_memory)), key=self.peak_memory.__getitem__)
        return r, self.peak_memory[r] - self.memory_limit


OPTIMIZERS = ("adamw", "muon")  # what the planner prices (--optimizer)


@dataclass(frozen=True)
class Precision:
    """Bytes per parameter element: weights, gradients (fp32 accumulation), optimizer states (Adam)."""

    name: str
    weight: int
    grad: int
    optim: int   # Adam m + v (+ fp32 master weights in mixed precision)

    @property
    def adam(self) -> int:
        """Adam's two states alone (``optim`` without a master copy)."""
        return self.optim - (MASTER_BYTES if self.weight < 4 else 0)

    @staticmethod
    def for_profile(profile: ModelProfile) -> "Precision":
        pbytes = sum(k.param_bytes for k in profile.kinds)
        params = sum(k.params for k in profile.kinds) or 1
        if pbytes / params < 3:
            return Precision("bf16 weights, fp32 grads, fp32 master + Adam", 2, 4, 12)
        return Precision("fp32 weights, grads, Adam", 4, 4, 8)


def runtime_overhead(device) -> float:
    """Fixed per-process memory outside tensors the planner sees: CUDA context, NCCL buffers,
    allocator slack. The cpu profile measures live tensor bytes, so nothing is added there."""
    return 0.0 if device.name == "cpu" else 2.0 * GiB


class Evaluator:
    """Prices candidates of one model on one device; caches unit times per (kind, scale)."""

    def __init__(self, profile: ModelProfile, device, memory_limit: float, global_batch: int,
                 bucket_bytes: float = 25 * 2 ** 20, moe_imbalance: float = DEFAULT_MOE_IMBALANCE,
                 loss_chunking: bool = True, offloading: bool = True, optimizer: str = "adamw"):
        if optimizer not in OPTIMIZERS:
            raise ValueError(f"autopar plan: optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
        self.optimizer = optimizer
        if not moe_imbalance >= 1.0:
            raise ValueError(f"moe_imbalance is the max/mean ratio of the rows an expert-parallel rank receives: "
                             f"it must be >= 1, got {moe_imbalance}")
        self.moe_imbalance = float(moe_imbalance)
        self.profile = profile
        self.device = device
        self.memory_limit = float(memory_limit)
        self.global_batch = global_batch
        self.bucket_bytes = bucket_bytes
        self.precision = Precision.for_profile(profile)
        self.units = profile.units
        self._dispatch: dict = {}  # unit_times' key -> exposed (F, I) MoE all-to-all seconds
        self._times: dict = {}
        self._sims: dict = {}   # identical pipelines (e.g. ZeRO 0/1/2 of one layout) simulate once
        self._act_peaks: dict = {}  # (schedule, per-stage amounts) -> per-rank activation peaks
        self._zl: dict = {}  # (zero, replicas, expert replicas, ep, bounds, stage_to_rank, rank) -> ZeroLayout
        self._chunked: Evaluator | None = None
        self.loss_chunking = loss_chunking
        self.offloading = offloading

    @property
    def chunked(self) -> "Evaluator | None":
        """The Evaluator of the same model with its loss chunked (``ModelProfile.chunked``), on
        the same device, limit and batch; None when the model has no chunkable loss (or
        ``loss_chunking`` is off)."""
        if self.profile.chunked is None or not self.loss_chunking:
            return None
        if self._chunked is None:
            self._chunked = Evaluator(self.profile.chunked, self.device, self.memory_limit, self.global_batch,
                                      self.bucket_bytes, self.moe_imbalance, offloading=self.offloading,
                                      optimizer=self.optimizer)
        return self._chunked

    def expert_replicas(self, lay: Layout) -> int:
        """Ranks holding the same experts (the expert-data-parallel group): dp*cp/ep."""
        return max(1, (lay.dp * lay.cp) // lay.ep)

    def routed(self, kind: UnitKind, lay: Layout) -> tuple[float, float]:
        """(mean, worst rank) bytes the unit's token-proportional MoE dispatch keeps from F to W
        per microbatch on one rank: the received rows and the experts' saved activations. The
        worst rank receives ``moe_imbalance`` times the mean under expert parallelism; a rank
        holding every expert (ep = 1) gets exactly the routed rows. (0, 0) without a routed MoE."""
        r = kind.routed
        if r is None:
            return 0.0, 0.0
        mean = r.rows * self.scale(lay) * r.saved_row_bytes
        return mean, mean * (self.moe_imbalance if lay.ep > 1 else 1.0)

    def unit_saved(self, kind: UnitKind, lay: Layout) -> tuple[float, float]:
        """(after F, after I) bytes one microbatch of the unit keeps, routed MoE imbalance included
        (the capture holds the mean routed rows; the worst rank keeps ``moe_imbalance`` times them),
        and the key/value head copies context parallelism adds until I (``kv_copies_bytes``)."""
        sc = self.scale(lay)
        mean, worst = self.routed(kind, lay)
        copies = kind.kv_copies_bytes(lay.cp) * sc
        return kind.saved_bytes * sc + worst - mean + copies, kind.saved_after_i * sc + worst - mean

    # ------------------------------------------------------------------ per-unit quantities
    def scale(self, lay: Layout) -> float:
        return lay.b / self.profile.batch0 / lay.cp

    def links(self, lay: Layout):
        d = self.device
        return {"cp": comm.group_link(d, lay.cp, 1), "dp": comm.group_link(d, lay.dp * lay.cp, 1),
                "ep": comm.group_link(d, lay.ep, 1), "pp": comm.group_link(d, lay.pp, lay.dp * lay.cp),
                "edp": comm.group_link(d, self.expert_replicas(lay), lay.ep)}

    @staticmethod
    def _time_key(kind: UnitKind, lay: Layout) -> tuple:
        return id(kind), lay.b, lay.cp, lay.ep, lay.dp if lay.zero == 3 else 0, lay.zero == 3

    def unit_times(self, kind: UnitKind, lay: Layout) -> tuple[float, float, float]:
        key = self._time_key(kind, lay)
        hit = self._times.get(key)
        if hit is not None:
            return hit
        sc = self.scale(lay)
        f, i, w = kind.times(self.device, sc)
        links = self.links(lay)
        if lay.cp > 1 and kind.attention_bytes:
            a2a = comm.all_to_all_time((kind.attention_bytes + kind.kv_copies_bytes(lay.cp)) * sc, lay.cp, links["cp"])
            f, i = f + a2a, i + a2a
        r = kind.routed
        if lay.ep > 1 and r is not None:
            # token-proportional dropless dispatch: per MoE and microbatch the routed rows go out
            # and come back (dispatch, combine) in F, and again as gradients in I, priced by the
            # worst rank's receive (moe_imbalance x the mean N*k rows); that rank also runs its
            # experts on the extra rows (F, I and W: one GEMM each per forward GEMM)
            imb = self.moe_imbalance
            rate = self.device.flops_rate(r.dtype)
            one = comm.all_to_all_time(r.rows * sc * imb * r.row_bytes, lay.ep, links["ep"])
            # passes/moe_overlap.py: each all-to-all flies while the independent work of its
            # window (a shared expert; its input gradients in I) computes: only the rest is exposed
            a2a_f = sum(max(0.0, one - h * sc / rate) for h in r.overlap_f)
            a2a_i = sum(max(0.0, one - h * sc / rate) for h in r.overlap_i)
            self._dispatch[key] = (a2a_f, a2a_i)
            extra = (imb - 1.0) * r.rows * sc * r.flops_per_row / rate
            f, i, w = f + a2a_f + extra, i + a2a_i + extra, w + extra
        elif lay.ep > 1 and kind.dispatch_bytes:  # static capacity: the whole expert buffers move
            a2a = 2 * comm.all_to_all_time(kind.dispatch_bytes * sc, lay.ep, links["ep"])
            f, i = f + a2a, i + a2a
        if lay.zero == 3 and lay.dp * lay.cp > 1:
            # runtime/sharded.py: F and I of every microbatch gather the unit's layer group (W
            # reads no parameters); the reduce-scatter is once per step (after_pipeline); expert
            # weights gather over their expert-data-parallel group
            n_exp = kind.expert_params / lay.ep
            e = self.expert_replicas(lay)
            wb = self.precision.weight
            gather = self.collective("all_gather", (kind.params - kind.expert_params) * wb, lay.dp * lay.cp,
                                     links["dp"])
            if e > 1 and n_exp:
                gather += self.collective("all_gather", n_exp * wb, e, links["edp"])
            if self.device.name == "cpu":  # gloo and the programs share the cores: nothing hides
                f, i = f + gather, i + gather
            else:  # prefetched into the other buffer while the previous group computes
                f, i = max(f, gather), max(i, gather)
        self._times[key] = (f, i, w)
        return self._times[key]

    def dispatch_exposed(self, kind: UnitKind, lay: Layout) -> tuple[float, float]:
        """(F, I) seconds of the unit's dropless MoE all-to-alls that ``unit_times`` prices as
        exposed (a static-capacity MoE's are graph collectives: replayed by recomputation, never
        interleaved with another program)."""
        self.unit_times(kind, lay)
        return self._dispatch.get(self._time_key(kind, lay), (0.0, 0.0))

    def unit_params(self, kind: UnitKind, lay: Layout) -> float:
        """Parameter elements of a unit held by one rank before ZeRO sharding (experts split by ep)."""
        return (kind.params - kind.expert_params) + kind.expert_params / lay.ep

    def unit_weight_bytes(self, kind: UnitKind, lay: Layout) -> float:
        return self.unit_params(kind, lay) * self.precision.weight

    def unit_static(self, kind: UnitKind, lay: Layout) -> float:
        """Parameter + gradient + optimizer bytes of one unit on one rank, after ZeRO sharding,
        without the ZeRO-2/3 padding (at most what ``memory`` counts for the unit). Expert
        weights (split by ep) are sharded the same way over their expert-data-parallel group
        (dp*cp/ep ranks; whole when that group is one rank)."""
        n_exp = kind.expert_params / lay.ep
        n = kind.params - kind.expert_params
        return (sum(self.static_per_elem(lay.zero, lay.dp * lay.cp, kind.small_params / n if n else 0.0)) * n
                + sum(self.static_per_elem(lay.zero, self.expert_replicas(lay))) * n_exp
                - self.muon_state_saving(kind, lay))

    def muon_shards(self, kind: UnitKind, lay: Layout) -> tuple[float, float]:
        """(elements, Newton-Schulz FLOPs) of ``kind``'s Muon matrices one rank steps (0 unless
        ``optimizer == "muon"``): expert ones split by ep; under ZeRO >= 1 each replica steps
        the matrices of its own shard (parallel/zero_layout.aligned_offsets: about 1/R of
        them), under ZeRO-0 every replica steps them all."""
        if self.optimizer != "muon":
            return 0.0, 0.0
        d, e = lay.dp * lay.cp, self.expert_replicas(lay)
        gd = d if lay.zero >= 1 and d > 1 else 1
        ge = e if lay.zero >= 1 and e > 1 else 1
        dense = kind.muon_params - kind.muon_expert_params
        experts = kind.muon_expert_params / lay.ep
        flops = (kind.muon_flops - kind.muon_expert_flops) / gd + kind.muon_expert_flops / lay.ep / ge
        return dense / gd + experts / ge, flops

    def muon_state_saving(self, kind: UnitKind, lay: Layout) -> float:
        """Optimizer bytes Muon saves on one rank against Adam for ``kind``: one fp32 momentum
        per matrix element where Adam keeps two moments."""
        return 4.0 * self.muon_shards(kind, lay)[0]

    def static_per_elem(self, zero: int, g: int, small: float = 0.0) -> tuple[float, float, float]:
        """(weight, gradient, optimizer) bytes per parameter element sharded over ``g`` replicas at
        ZeRO level ``zero``, without padding; ``small``: the share of ZeRO-3's resident group
        (norms, biases: kept whole)."""
        p = self.precision
        if zero >= 2 and g > 1:
            grads = 4.0 * (1 + 1 / g)  # the flat fp32 buffers and their shards
            if zero == 3:  # fp32 master shards, the resident group whole
                return MASTER_BYTES / g + p.weight * small, grads, p.adam / g
            return p.weight, grads, (p.adam + MASTER_BYTES) / g
        master = 4 if (zero in (1, 2) and g > 1 and p.weight == 4) else 0
        return p.weight, p.grad, (p.optim + master) / (g if zero >= 1 else 1)

    def grad_per_param(self, lay: Layout) -> float:
        """Gradient bytes per parameter element at the backward's peak. ZeRO-0/1: the gradients.
        ZeRO-2/3 (``runtime/sharded.py``): a layer group's gradients accumulate whole in its flat
        fp32 buffer over the step's microbatches and are reduce-scattered after the group's last
        W (one reduce-scatter per step, not per microbatch), into an fp32 shard: 4 + 4/d."""
        d = lay.dp * lay.cp
        if lay.zero >= 2 and d > 1:
            return 4.0 + 4.0 / d
        return self.precision.grad

    def optim_per_param(self, lay: Layout) -> float:
        """Optimizer bytes per (sharded) parameter element: Adam's states, plus for ZeRO-1/2 over
        dp > 1 with fp32 weights the fp32 master shard ``runtime/zero.py`` / ``sharded.py`` keep
        beside the whole weights (the parameter the inner optimizer steps; with bf16 weights the
        master is already in ``optim``; under ZeRO-3 the shard is the weight)."""
        p = self.precision
        master = 4 if (lay.zero in (1, 2) and lay.dp * lay.cp > 1 and p.weight == 4) else 0
        return p.optim + master

    def reduction_bytes(self, lay: Layout, n: float, n_exp: float = 0.0) -> tuple[str, float]:
        """(name, bytes) of the gradient-reduction buffers a rank holding ``n`` parameter
        elements allocates after its backward (none with dp = 1):

        * ZeRO-0, ``runtime/grad_reduce.py``: every bucket is flattened into an fp32 buffer and
          all of them stay in flight until the reduction finishes: 4 bytes per element;
        * ZeRO-1, ``runtime/zero.py``: the flat fp32 gradients (padded to a multiple of dp), the
          reduce-scattered shard and the all-gathered parameters: 4 * (2n + n/d);
        * ZeRO-2/3, ``runtime/sharded.py``: beyond the flat gradients and their shards, which
          ``grad_per_param`` counts, none on NCCL; on the ``cpu`` profile gloo's
          ``reduce_scatter_tensor`` copies its whole input while it is in flight (measured: a
          4 MiB reduce-scatter over 2 gloo ranks peaks 4 MiB above its input and output), and
          a rank's groups are reduce-scattered together after its last W: 4n.

        ``n_exp`` of the ``n`` elements are expert weights, whose ZeRO-1 shard is over the
        expert-data-parallel group (dp*cp/ep)."""
        d = lay.dp * lay.cp
        if d <= 1:
            return "dp buckets", 0.0
        if lay.zero == 0:
            return "dp buckets", 4.0 * n
        if lay.zero == 1:
            return "zero-1 buffers", 4.0 * (2 * n + (n - n_exp) / d + n_exp / self.expert_replicas(lay))
        return "dp buckets", 4.0 * n if self.device.name == "cpu" else 0.0

    # ------------------------------------------------------------------ stages
    def stage_kinds(self, part: Partition) -> list[list[UnitKind]]:
        b = part.bounds
        return [[u.kind for u in self.units[b[s]:b[s + 1]]] for s in range(len(b) - 1)]

    def stage_costs(self, lay: Layout, part: Partition) -> Costs:
        """Per-stage F, I, W seconds: the sums of the stage's unit times, plus what the runtime
        does around them:

        * stage 0 receives no activation (only the model inputs, which need no gradient), so
          its I program is empty and its W computes the whole backward of the stage;
        * after every W (or B) the runtime adds the program's parameter gradients into
          ``.grad`` (``runtime/stage_work.py``: one ``add_`` per parameter tensor): one node
          overhead per tensor plus reading both and writing the sum;
        * on the ``cpu`` profile, every P2P message a stage's F (activations) or I/B
          (gradients) sends or receives across ranks costs that rank ``CPU_P2P_MESSAGE_S`` of
          compute time (gloo's threads share the cores with the compute threads)."""
        from autopar.schedules.registry import layout as stage_layout

        f, i, w, comm_f, comm_i = [], [], [], [], []
        bw = self.stream_bandwidth(lay)
        S = len(part.bounds) - 1
        s2r = stage_layout(lay.schedule, lay.pp, lay.v) if lay.pp > 1 else (0,) * S
        msg_cpu = CPU_P2P_MESSAGE_S if (self.device.name == "cpu" and lay.pp > 1) else 0.0
        parked_bytes = self.parked(lay, part, self.stage_amounts(lay, part)[1])[0] if lay.offload else []
        for s, (kinds, rc) in enumerate(zip(self.stage_kinds(part), part.recompute)):
            tf = ti = tw = cf = ci = 0.0
            for k in kinds:
                a, bb, c = self.unit_times(k, lay)
                tf, ti, tw = tf + a, ti + bb, tw + c
                xf, xi = self.dispatch_exposed(k, lay)
                cf, ci = cf + xf, ci + xi
            if rc:
                # I replays the forward first, but never a MoE dispatch's all-to-alls (its experts
                # run again inside the op: their FLOPs are in tf)
                ti += tf - cf
            if s == 0:
                ti, tw = 0.0, ti + tw
            n = sum(self.unit_params(k, lay) for k in kinds) - self.shared_duplicates(part, [s])
            tw += sum(k.param_tensors for k in kinds) * self.device.op_overhead_s + 3 * n * self.precision.weight / bw
            if msg_cpu:  # a message this stage's F / I sends or receives across ranks
                tf += msg_cpu * ((s > 0 and s2r[s - 1] != s2r[s]) + (s + 1 < S and s2r[s + 1] != s2r[s]))
                ti += msg_cpu * ((s > 0 and s2r[s - 1] != s2r[s]) + (s + 1 < S and s2r[s + 1] != s2r[s]))
            if lay.offload:  # the copy out after F, the copy back before I: what compute does not hide
                t_copy = self.offload_seconds(lay, parked_bytes[s])
                sync = self.device.name == "cpu"
                tf += t_copy if sync else max(0.0, t_copy - tf)
                ti += t_copy if sync else max(0.0, t_copy - ti)
            f.append(max(tf, 1e-12))
            i.append(max(ti, 1e-12))
            w.append(max(tw, 1e-12))
            comm_f.append(cf)
            comm_i.append(ci)
        return Costs(f=tuple(f), i=tuple(i), w=tuple(w), fb_ratio=self.fb_ratio(lay, f, i, w, comm_f, comm_i))

    def fb_ratio(self, lay: Layout, f, i, w, comm_f, comm_i) -> float:
        """DualPipeV's F&B units run their two programs interleaved at the MoE all-to-alls
        (runtime/execute.py ``run_paired``; not under ZeRO-3): each half's exposed all-to-all
        time hides behind the other half's compute, ``min(comm_F, compute_B) + min(comm_B,
        compute_F)`` per unit, priced on the stage means (a unit pairs two stages of one rank).
        1.0 (nothing hidden) otherwise."""
        if lay.schedule != "dualpipev" or lay.zero == 3 or not any(comm_f) and not any(comm_i):
            return 1.0
        n = len(f)
        F, B = sum(f) / n, (sum(i) + sum(w)) / n
        cF, cB = sum(comm_f) / n, sum(comm_i) / n
        hidden = min(cF, B - cB) + min(cB, F - cF)
        return max(0.05, 1.0 - hidden / (F + B))

    def stage_bytes(self, lay: Layout, part: Partition) -> tuple[float, ...]:
        return tuple(max(x, 1.0) for x in self.stage_amounts(lay, part)[0])  # >= 1 byte: zb-auto divides by it

    def stage_amounts(self, lay: Layout, part: Partition, moe: bool = True) -> tuple[tuple, tuple]:
        """Per stage, the bytes one microbatch keeps after F and after I (``unit_saved``; a
        recomputing stage keeps its input); ``moe=False``: without the routed MoE rows."""
        sc = self.scale(lay)
        after_f, after_i = [], []
        for kinds, rc in zip(self.stage_kinds(part), part.recompute):
            if rc:
                # the stage keeps its input; a MoE dispatch (never recomputed) keeps its received
                # rows from F, and from I (its experts run again) until W everything it keeps
                # without recomputation, plus the rows' gradients
                a = kinds[0].in_bytes * sc
                kept_f = kept_i = 0.0
                if moe:
                    for k in kinds:
                        r = k.routed
                        if r is None or not r.saved_row_bytes:
                            continue
                        worst = self.routed(k, lay)[1]
                        kept_f += worst * r.row_bytes / r.saved_row_bytes
                        kept_i += worst * (r.saved_row_bytes + r.row_bytes) / r.saved_row_bytes
                after_f.append(a + kept_f)
                after_i.append(a + kept_i)
                continue
            f = i = 0.0
            for k in kinds:
                a, b = self.unit_saved(k, lay)
                if not moe:
                    worst = self.routed(k, lay)[1]
                    a, b = max(0.0, a - worst), max(0.0, b - worst)
                f, i = f + a, i + b
            after_f.append(f)
            after_i.append(i)
        return tuple(after_f), tuple(after_i)

    def i_free_fraction(self, part: Partition) -> float:
        """Share of a stage's saved bytes released by I (the smallest over stages: conservative)."""
        fr = []
        for kinds, rc in zip(self.stage_kinds(part), part.recompute):
            saved = sum(k.saved_bytes for k in kinds)
            after = sum(k.saved_after_i for k in kinds)
            fr.append(0.0 if rc or saved <= 0 else max(0.0, 1.0 - after / saved))
        return min(fr) if fr else 0.5

    def activation_peaks(self, sched, lay: Layout, part: Partition, moe: bool = True) -> tuple[float, ...]:
        """Per-rank peak of saved activations over the schedule's action order (bytes).

        ``schedules.simulate.peak_memory`` with per-stage amounts after F and after I: after I a
        microbatch holds what W reads (``saved_after_i``), the saved values plus what I computed
        for W, which can exceed what F saved. A recomputing stage keeps
        only its input until I, and its I/W pair is counted as keeping that.

        Fixed-order schedules (every one but zb-auto; ``sched`` may then be None) take the
        schedule's in-flight frontier (:func:`inflight_frontier`), which gives the same peaks as
        walking the built schedule without building it at every m."""
        after_f, after_i = self.stage_amounts(lay, part, moe)
        if lay.offload:
            return self.offload_peaks(sched, lay, part, after_f, after_i)[0]
        if lay.schedule != "zb-auto" or sched is None:
            return frontier_peaks(inflight_frontier(lay.schedule, lay.pp, lay.m, lay.v), after_f, after_i)
        key = (id(sched), tuple(after_f), tuple(after_i))
        hit = self._act_peaks.get(key)
        if hit is not None and hit[0] is sched:
            return hit[1]
        peaks = peak_memory(sched, after_f, after_i_bytes=after_i)
        self._act_peaks[key] = (sched, peaks)
        return peaks

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

    def message_bytes(self, lay: Layout, part: Partition) -> tuple[float, ...]:
        b = part.bounds
        return tuple(self.units[b[s + 1] - 1].kind.out_bytes * self.scale(lay) for s in range(len(b) - 2))

    # ------------------------------------------------------------------ whole plan
    def schedule(self, lay: Layout, part: Partition, costs: Costs):
        from autopar.schedules.registry import layout as stage_layout

        if lay.schedule == "zb-auto":
            sb = self.stage_bytes(lay, part)
            s2r = stage_layout(lay.schedule, lay.pp, lay.v)
            static = self.static_per_rank(lay, part, s2r)
            budget = self.memory_limit - max(static)
            limit = max(budget, 1.0)
            try:
                return build("zb-auto", lay.pp, lay.m, lay.v, costs=costs, memory_limit=limit,
                             stage_bytes=sb, i_free_fraction=self.i_free_fraction(part))
            except ValueError:
                return build("zb-auto", lay.pp, lay.m, lay.v, costs=costs, stage_bytes=sb,
                             i_free_fraction=self.i_free_fraction(part))
        return fixed_schedule(lay.schedule, lay.pp, lay.m, lay.v)

    def static_per_rank(self, lay: Layout, part: Partition, s2r) -> list[float]:
        static = [0.0] * lay.pp
        for s, kinds in enumerate(self.stage_kinds(part)):
            static[s2r[s]] += sum(self.unit_static(k, lay) for k in kinds)
        per_elem = self.unit_static_per_param(lay)
        for r in range(lay.pp):
            static[r] -= self.shared_duplicates(part, [s for s in range(len(s2r)) if s2r[s] == r]) * per_elem
        return static

    def unit_static_per_param(self, lay: Layout) -> float:
        d = lay.dp * lay.cp
        p = self.precision
        return (p.weight / (d if lay.zero >= 3 else 1) + self.grad_per_param(lay)
                + self.optim_per_param(lay) / (d if lay.zero >= 1 else 1))

    def shared_duplicates(self, part: Partition, stages) -> float:
        """Parameter elements counted more than once when ``stages`` are held together (a tied
        weight in two of them is one tensor, one gradient, one optimizer state)."""
        shared = getattr(self.profile, "shared_params", ())
        if not shared:
            return 0.0
        b = part.bounds
        held = [u for s in stages for u in range(b[s], b[s + 1])]
        extra = 0.0
        for units, numel in shared:
            c = sum(1 for u in held if u in units)
            if c > 1:
                extra += (c - 1) * numel
        return extra

    def rank_params(self, lay: Layout, part: Partition, s2r, rank: int) -> float:
        """Parameter elements one rank holds (before ZeRO sharding), shared ones once."""
        stages = [s for s in range(len(s2r)) if s2r[s] == rank]
        kinds = self.stage_kinds(part)
        return sum(self.unit_params(k, lay) for s in stages for k in kinds[s]) - self.shared_duplicates(part, stages)

    def grad_output_bytes(self, lay: Layout, part: Partition, s2r, rank: int) -> float:
        """Fresh parameter gradients one W/B program of this rank holds beyond what it frees:
        ZeRO-2/3 only (otherwise the programs accumulate into ``.grad`` in place and return no
        fresh gradients; runtime/stage_work.py, passes/exec_code.py). The program frees the
        microbatch's saved values as it consumes them (boxed calling convention) while the
        gradients appear, so a stage counts max(0, its gradients - what its W reads)."""
        if lay.zero < 2 or lay.dp * lay.cp == 1:
            return 0.0
        kinds = self.stage_kinds(part)
        sc = self.scale(lay)
        best = 0.0
        for s in range(len(s2r)):
            if s2r[s] == rank:
                n = sum(self.unit_params(k, lay) for k in kinds[s]) - self.shared_duplicates(part, [s])
                freed = kinds[s][0].in_bytes * sc if part.recompute[s] else sum(k.saved_after_i for k in kinds[s]) * sc
                best = max(best, n * self.precision.weight - freed)
        return best

    def p2p_bytes(self, lay: Layout, part: Partition, s2r, rank: int) -> float:
        """Sent tensors the runtime still holds, plus two receive buffers. A send is dropped once
        a later message from its receiver proves it arrived (runtime/send_release.py): the
        activations sent for a microbatch when its gradient comes back, a gradient at the next
        activation; so each boundary that crosses ranks holds at most the sending stage's
        microbatches in flight plus one (:func:`stage_inflight`), whatever m is."""
        if lay.pp == 1:
            return 0.0
        sc = self.scale(lay)
        b = part.bounds
        S = len(b) - 1
        n = stage_inflight(lay.schedule, lay.pp, lay.m, lay.v)
        held = recv = 0.0
        for s in range(S):
            if s2r[s] != rank:
                continue
            if s + 1 < S and s2r[s + 1] != rank:   # sends activations forward, receives their gradients
                out = self.units[b[s + 1] - 1].kind.out_bytes * sc
                held += min(lay.m, n[s] + 1) * out
                recv = max(recv, out)
            if s > 0 and s2r[s - 1] != rank:       # receives activations, sends their gradients back
                inp = self.units[b[s]].kind.in_bytes * sc
                held += min(lay.m, n[s] + 1) * inp
                recv = max(recv, inp)
        return held + 2 * recv

    def evaluate(self, lay: Layout, part: Partition) -> Estimate:
        costs = self.stage_costs(lay, part)
        sched = self.schedule(lay, part, costs)
        s2r = sched.stage_to_rank
        links = self.links(lay)
        msg = self.message_bytes(lay, part)
        sb = self.stage_bytes(lay, part)
        frac = self.i_free_fraction(part)
        alpha = links["pp"].alpha_s
        if self.device.name == "cpu":
            alpha = max(alpha, CPU_P2P_LATENCY_S)
        key = (id(sched), costs, msg, links["pp"], sb, frac)
        sim = self._sims.get(key)
        if sim is None:
            sim = simulate(sched, costs, p2p_latency=alpha, p2p_bandwidth=links["pp"].bandwidth,
                           message_bytes=msg, stage_bytes=sb, i_free_fraction=frac, memory=False)
            self._sims[key] = sim
        memory, peaks = self.memory(lay, part, s2r, self.activation_peaks(sched, lay, part), sched)
        dp_exposed, opt = self.after_pipeline(lay, part, s2r, sim, links)
        p = self.precision
        est = Estimate(layout=lay, partition=part, stage_to_rank=tuple(s2r), stage_costs=costs,
                       makespan_s=sim.makespan, dp_exposed_s=dp_exposed, optimizer_s=opt,
                       bubble=sim.bubble_fraction, peak_memory=tuple(peaks), memory=tuple(memory),
                       memory_limit=self.memory_limit, message_bytes=msg,
                       p2p_link=(alpha, links["pp"].bandwidth), schedule_obj=sched)
        tokens = self.global_batch * (self.profile.seq_len or 1)
        est.tokens_per_s = tokens / est.step_time
        if lay.offload:
            est.host_bytes, est.offload_exposed_s = self.offload_report(lay, part, sched, costs)
        flops = self.profile.flops_per_sample() * self.global_batch
        peak = self.device.flops_rate("bfloat16" if p.weight == 2 else "float32") / self.device.flops_efficiency
        est.mfu = flops / (est.step_time * lay.world * peak)
        return est

    def after_pipeline(self, lay: Layout, part: Partition, s2r, sim, links) -> tuple[float, float]:
        """(exposed synchronisation, optimizer) seconds after the pipeline, for the rank that
        finishes last. Per rank, in the runtime's order (``runtime/distributed.py`` ``run``):

        * tied weights held by several pipeline ranks: their gradients are summed over the
          holders (blocking; waits for the last holder to finish its actions);
        * ZeRO-0, dp > 1 (``runtime/grad_reduce.py``): a stage's buckets are flattened and
          their all-reduce launched when its LAST W/B of the step has run, so the reduction
          overlaps only with the rank's later actions (other stages of a v > 1 schedule); then
          the sums are copied back;
        * ZeRO-1, dp > 1 (``runtime/zero.py``, inside ``optimizer.step``): flatten every
          gradient, reduce-scatter, step the shard, all-gather the parameters, copy them back;
          nothing overlaps;
        * the loss is broadcast over the pipeline and summed over dp (one latency each);
        * the optimizer (:meth:`optimizer_time`).

        * ZeRO-2/3, dp > 1 (``runtime/sharded.py``): each layer group's reduce-scatter starts
          after its last W and hides behind the rank's last backward (not on ``cpu``, where
          gloo shares the cores); ZeRO-2's parameter all-gather and copy follow the step."""
        d = lay.dp * lay.cp
        p = self.precision
        bw = self.stream_bandwidth(lay)
        ov = self.device.op_overhead_s
        kinds = self.stage_kinds(part)
        done: dict[int, float] = {}
        end = [0.0] * lay.pp
        last_bwd = [(0.0, 0.0)] * lay.pp   # (end, duration) of the rank's last I/W/B
        for r, a, t0, t1 in sim.timeline:
            if t1 > end[r]:
                end[r] = t1
            if a.type in ("W", "B", "I"):
                if t1 >= last_bwd[r][0]:
                    last_bwd[r] = (t1, t1 - t0)
                if a.type != "I" and t1 > done.get(a.stage, 0.0):
                    done[a.stage] = t1
        # tied weights across pipeline ranks: (elements, holder ranks)
        tied = []
        for units, numel in getattr(self.profile, "shared_params", ()):
            ranks = sorted({s2r[s] for s in range(len(s2r)) for u in units
                            if part.bounds[s] <= u < part.bounds[s + 1]})
            if len(ranks) > 1:
                tied.append((numel, ranks))
        finish, opt_of = [], []
        for r in range(lay.pp):
            stages = sorted((s for s in range(len(s2r)) if s2r[s] == r), key=lambda s: done.get(s, 0.0))
            # Muon's whole-matrix shards: their padding is reduced and gathered with the rest
            dealt = self.muon_dealt(lay, part, s2r, r)
            pad = dealt[0] if dealt else 0.0
            n = self.rank_params(lay, part, s2r, r)
            n_e = sum(k.expert_params for s in stages for k in kinds[s]) / lay.ep
            tensors = sum(k.param_tensors for s in stages for k in kinds[s])
            t = end[r]
            for numel, ranks in tied:
                if r in ranks:
                    t = max(t, max(end[q] for q in ranks)) + self.collective("all_reduce", numel * p.grad, len(ranks),
                                                                            links["pp"])
            if d > 1 and lay.zero == 0:
                tr = 0.0
                for s in stages:
                    ns = sum(self.unit_params(k, lay) for k in kinds[s]) - self.shared_duplicates(part, [s])
                    ns_e = sum(k.expert_params for k in kinds[s]) / lay.ep
                    tr = max(tr, done.get(s, end[r])) + 2 * 4 * ns / bw \
                        + self.group_collective("all_reduce", 4, ns - ns_e, ns_e, lay, links)
                t = max(t, tr) + 2 * 4 * n / bw + tensors * ov
            elif d > 1 and lay.zero == 1:
                t += (3 * 4 * n / bw + 2 * tensors * ov                                # flatten
                      + self.group_collective("reduce_scatter", 4, n - n_e + pad, n_e, lay, links)
                      + self.group_collective("all_gather", 4, n - n_e + pad, n_e, lay, links)
                      + 2 * 4 * n / bw + tensors * ov)                                 # copy back
            elif d > 1 and lay.zero >= 2:
                # runtime/sharded.py: each layer group's flat fp32 gradients are reduce-scattered
                # once, after its last W; ZeRO-2 then all-gathers the stepped shards and copies them
                red = self.group_collective("reduce_scatter", 4, n - n_e + pad, n_e, lay, links)
                t += red if self.device.name == "cpu" else max(0.0, red - last_bwd[r][1])
                if lay.zero == 2:
                    t += self.group_collective("all_gather", p.weight, n - n_e + pad, n_e, lay, links) + 2 * 4 * n / bw
            if lay.pp > 1:
                t += links["pp"].alpha_s
            if d > 1:
                t += links["dp"].alpha_s
            o = self.optimizer_time(lay, n, tensors, n_e)
            o += self.muon_time(lay, [k for s in stages for k in kinds[s]], dealt[1] if dealt else None)
            finish.append(t + o)
            opt_of.append(o)
        r = max(range(lay.pp), key=finish.__getitem__)
        return max(0.0, finish[r] - opt_of[r] - sim.makespan), opt_of[r]

    def group_collective(self, kind: str, elem_bytes: float, n_dense: float, n_exp: float, lay: Layout,
                         links) -> float:
        """A gradient/parameter collective of ``n_dense`` elements over dp*cp and ``n_exp``
        expert elements over their expert-data-parallel group (dp*cp/ep; none when it is one
        rank), one after the other."""
        t = self.collective(kind, elem_bytes * n_dense, lay.dp * lay.cp, links["dp"]) if n_dense > 0 else 0.0
        e = self.expert_replicas(lay)
        if n_exp > 0 and e > 1:
            t += self.collective(kind, elem_bytes * n_exp, e, links["edp"])
        return t

    def optimizer_time(self, lay: Layout, n: float, tensors: int, n_exp: float = 0.0) -> float:
        """One optimizer step over a rank's ``n`` parameter elements in ``tensors`` tensors.

        fp32 weights: ``torch.optim.Adam``/``AdamW`` as the runtime runs them (the per-tensor
        loop, PyTorch's CPU default; the CUDA default ``foreach`` makes the same passes): 8
        elementwise passes over the states, 20 four-byte element reads/writes per parameter
        (weight decay 2, ``lerp_`` of m 3, v ``mul_`` 2 and ``addcmul_`` 3, ``sqrt`` 2, divide 2,
        ``add_`` eps 2, ``addcdiv_`` 4), i.e. 80 bytes per element, plus ~12 node overheads per
        tensor (the ops, the step counter and its ``.item()``). Measured on the 2-core CI VM:
        5.2 ns per element on one 4M-element tensor (15.5 GB/s at 80 B/element, the
        streaming bandwidth the cpu profile measures) and 42 us per 8-element tensor. ZeRO-1
        steps one flat shard (one tensor of n/dp elements). bf16 weights: a fused
        mixed-precision Adam (read and write weights, gradients and states once). ``n_exp`` of
        the ``n`` elements are expert weights, sharded over dp*cp/ep instead of dp*cp."""
        d = lay.dp * lay.cp
        e = self.expert_replicas(lay)
        p = self.precision
        bw = self.stream_bandwidth(lay)
        sharded = (n - n_exp) / d + n_exp / e
        if lay.zero == 1 and d > 1:
            shard, tensors = sharded, 1
        else:
            shard = sharded if (lay.zero >= 1 and d > 1) else n
        moved = shard * (20 * 4 if p.weight == 4 else (p.weight + p.grad + p.optim) * 2)
        return moved / bw + self.device.op_overhead_s * tensors * 12

    def muon_time(self, lay: Layout, kinds, worst_flops: float | None = None) -> float:
        """What Muon adds to the optimizer step of a rank holding ``kinds`` over Adam's pricing of
        the same elements (``optimizer_time``): Newton-Schulz on its matrices (bfloat16 GEMMs at
        the device's matmul rate; ``worst_flops``: the replica that steps the most, from
        ``muon_dealt``, else 1/(dp*cp) of them at ZeRO >= 1), less the elementwise traffic Muon
        does not make (momentum and the Nesterov blend, 11 four-byte passes an element, against
        Adam's 20)."""
        if self.optimizer != "muon":
            return 0.0
        n = flops = 0.0
        for k in kinds:
            kn, kf = self.muon_shards(k, lay)
            n, flops = n + kn, flops + kf
        if worst_flops is not None:
            flops = worst_flops
        return flops / self.device.flops_rate("bfloat16") - n * (20 - 11) * 4 / self.stream_bandwidth(lay)

    def muon_dealt(self, lay: Layout, part: Partition, s2r, rank: int) -> tuple[float, float] | None:
        """Under ``optimizer="muon"`` and ZeRO >= 1: how the runtime deals ``rank``'s Muon
        matrices whole to the replicas (parallel/zero_layout.aligned_offsets: ZeRO-1 and ZeRO-2
        one set over all its layers, ZeRO-3 one per layer; expert shards over their
        expert-data-parallel group, or stepped whole where it is one rank): (the padding
        elements the whole-matrix shards add, Newton-Schulz FLOPs of the replica that steps the
        most). None otherwise, or when the profile's units carry no parameter names."""
        d, e = lay.dp * lay.cp, self.expert_replicas(lay)
        if (self.optimizer != "muon" or lay.zero == 0 or d == 1
                or not all(u.params or not u.kind.params for u in self.units)):
            return None
        key = ("muon", lay.zero, d, e, lay.ep, part.bounds, tuple(s2r), rank)
        if key in self._zl:
            return self._zl[key]
        muon = set().union(*(u.muon for u in self.units))
        experts = set().union(*(u.experts for u in self.units))
        specs = [s for s in self.rank_specs(part, s2r, rank) if s.fqn in muon]
        pad = worst = 0.0
        for expert, replicas in ((False, d), (True, e)):
            mine = [ParamSpec(s.fqn, (s.shape[0] // lay.ep,) + tuple(s.shape[1:])) if expert else s
                    for s in specs if (s.fqn in experts) == expert]
            if not mine:
                continue
            if replicas == 1:  # stepped whole by their one holder
                worst += sum(ns_flops(s.shape) for s in mine)
                continue
            groups: dict[str, list] = {}
            for s in mine:
                groups.setdefault(layer_group(s.fqn) if lay.zero == 3 else "", []).append(s.shape)
            for shapes in groups.values():
                offsets, padded = aligned_offsets(shapes, replicas)
                shard = padded // replicas
                per = [0.0] * replicas
                for o, shape in zip(offsets, shapes):
                    per[o // shard] += ns_flops(shape)
                pad += padded - sum(math.prod(shape) for shape in shapes)
                worst += max(per)
        self._zl[key] = (pad, worst)
        return pad, worst

    def stream_bandwidth(self, lay: Layout) -> float:
        """Bytes/s one rank streams through memory in the runtime's memory-bound work (gradient
        accumulation, optimizer, flattening): the profile's figure; on the ``cpu`` profile with
        several ranks, which share one machine's memory system and stream at the same time
        (every rank steps its optimizer together), ``CPU_SHARED_BANDWIDTH`` of it."""
        bw = self.device.mem_bandwidth * self.device.mem_efficiency
        if self.device.name == "cpu" and lay.world > 1:
            bw *= CPU_SHARED_BANDWIDTH
        return bw

    def collective(self, kind: str, nbytes: float, n: int, link) -> float:
        """Ring alpha-beta time of one collective; on the ``cpu`` profile (gloo between
        processes of one machine) at the effective bandwidth gloo reaches for that collective."""
        fn = {"all_reduce": comm.all_reduce_time, "reduce_scatter": comm.reduce_scatter_time,
              "all_gather": comm.all_gather_time}[kind]
        if self.device.name == "cpu":
            link = type(link)(alpha_s=link.alpha_s, bandwidth=link.bandwidth * GLOO_EFFICIENCY[kind])
        return fn(nbytes, n, link)

    def peak_memory_only(self, lay: Layout, part: Partition) -> list[float]:
        """Per-rank peak bytes of a fixed-order schedule, without timing it."""
        from autopar.schedules.registry import layout as stage_layout

        s2r = stage_layout(lay.schedule, lay.pp, lay.v) if lay.pp > 1 else (0,) * lay.num_stages
        return self.memory(lay, part, s2r, self.activation_peaks(None, lay, part))[1]

    def rank_specs(self, part: Partition, s2r, rank: int) -> list:
        """The ParamSpecs of every parameter ``rank`` holds (once each, in unit order)."""
        seen, out = set(), []
        for s in range(len(s2r)):
            if s2r[s] == rank:
                for u in self.units[part.bounds[s]: part.bounds[s + 1]]:
                    for spec in u.params:
                        if spec.fqn not in seen:
                            seen.add(spec.fqn)
                            out.append(spec)
        return out

    def zero_layout(self, lay: Layout, part: Partition, s2r, rank: int) -> ZeroLayout | None:
        """The ZeRO-2/3 layout ``rank`` shards its parameters into, exactly as the runtime
        builds it (autopar.parallel.zero_layout); None without ZeRO-2/3 over replicas or when
        the profile's units carry no parameter names. Expert weights with an expert dimension
        ep divides are in it with their local shape, over dp*cp/ep (``expert_replicas``);
        ``zero_layout_experts`` says whether they are. Computed once per (ZeRO level,
        replicas, ep, boundaries, stage layout, rank): layouts differing in m or b share it."""
        return self._zero_layout(lay, part, s2r, rank)[0]

    def zero_layout_experts(self, lay: Layout, part: Partition, s2r, rank: int) -> bool:
        return self._zero_layout(lay, part, s2r, rank)[1]

    def _zero_layout(self, lay: Layout, part: Partition, s2r, rank: int) -> tuple[ZeroLayout | None, bool]:
        d = lay.dp * lay.cp
        if lay.zero < 2 or d == 1 or not all(u.params or not u.kind.params for u in self.units):
            return None, False
        e = self.expert_replicas(lay)
        key = (lay.zero, d, e, lay.ep, part.bounds, tuple(s2r), rank)
        hit = self._zl.get(key)
        if hit is not None:
            return hit
        experts = set().union(*(u.experts for u in self.units))
        holders: dict[str, set[int]] = {}
        for s in range(len(s2r)):
            for u in self.units[part.bounds[s]: part.bounds[s + 1]]:
                for spec in u.params:
                    holders.setdefault(spec.fqn, set()).add(s2r[s])
        tied = {f for f, ranks in holders.items() if len(ranks) > 1}
        specs = self.rank_specs(part, s2r, rank)
        mine = [spec for spec in specs if spec.fqn in experts]
        local = (_ZL_EXPERTS and e > 1 and bool(mine)
                 and all(spec.shape and spec.shape[0] % lay.ep == 0 for spec in mine))
        plain = [spec for spec in specs if spec.fqn not in experts]
        # autopar.Muon: its matrices in option set 1, each whole in one replica's shard (the padding priced)
        muon = {"option_of": {f: 1 for u in self.units for f in u.muon}, "aligned": {1}} \
            if self.optimizer == "muon" else {}
        if local:
            plain = [spec if spec.fqn not in experts
                     else ParamSpec(spec.fqn, (spec.shape[0] // lay.ep,) + tuple(spec.shape[1:])) for spec in specs]
            zl = zero_layout(plain, lay.zero, d, tied - experts, experts={s.fqn for s in mine}, expert_replicas=e,
                             **muon)
        else:
            zl = zero_layout(plain, lay.zero, d, tied, **muon)
        self._zl[key] = (zl, local)
        return zl, local

    def memory(self, lay: Layout, part: Partition, s2r, act_peaks, sched=None,
               split_moe: bool = True) -> tuple[list[dict], list[float]]:
        """Per-rank components (bytes) and totals; ``act_peaks`` from :meth:`activation_peaks`
        (``sched``: the built schedule, needed only for zb-auto's MoE receive split). Of the
        activation peak, "moe receive" is what the routed MoE rows (received rows and the
        experts' saved activations, at the worst rank's imbalance) add to it (``split_moe=False``:
        not split out, for totals only)."""
        sc = self.scale(lay)
        rows, totals = [], []
        stage_kinds = self.stage_kinds(part)
        moe_free = None
        if split_moe and any(u.kind.routed is not None for u in self.units) and (
                lay.schedule != "zb-auto" or sched is not None):
            moe_free = self.activation_peaks(sched, lay, part, moe=False)
        for r in range(lay.pp):
            kinds = [k for s in range(len(s2r)) if s2r[s] == r for k in stage_kinds[s]]
            n = self.rank_params(lay, part, s2r, r)
            n_exp = sum(k.expert_params for k in kinds) / lay.ep
            static = self._static_rows(lay, part, s2r, r, n, n_exp, kinds)
            gather = static.pop("zero-3 gather")
            act = float(act_peaks[r])
            moe = max(0.0, act - moe_free[r]) if moe_free is not None else 0.0
            # the last unit's working set beyond the others': the logits and loss (chunked or not)
            last = self.units[-1].kind if self.units[-1].name == "epilogue" and s2r[-1] == r else None
            work = max((k.work(sc) for k in kinds if k is not last), default=0.0)
            # a recomputing stage's I replays its whole forward first: one microbatch's saved
            # values of every unit of the stage are live while its backward runs
            replay = max((sum(k.saved_bytes for k in stage_kinds[s]) * sc for s in range(len(s2r))
                          if s2r[s] == r and part.recompute[s]), default=0.0)
            work += replay
            loss_work = max(0.0, last.work(sc) - work) if last is not None else 0.0
            gout = self.grad_output_bytes(lay, part, s2r, r)
            # the reduction buffers come after the rank's backward, when its activations and
            # transients are gone: only what they need beyond the pipeline phase's peak counts
            red_name, red = self.reduction_bytes(lay, n, n_exp)
            row = {
                **static,
                "activations": act - moe,
                "moe receive": moe,
                "working": work,
                "logits/loss": loss_work,
                "grad outputs": gout,
                "p2p buffers": self.p2p_bytes(lay, part, s2r, r),
                "dp buckets": max(0.0, red - (act + work + loss_work + gout)) if red_name == "dp buckets" else 0.0,
                "zero-1 buffers": max(0.0, red - (act + work + loss_work + gout))
                if red_name == "zero-1 buffers" else 0.0,
                "zero-3 gather": gather,
                "runtime": runtime_overhead(self.device),
            }
            rows.append(row)
            totals.append(sum(row.values()))
        return rows, totals


    def _static_rows(self, lay: Layout, part: Partition, s2r, rank: int, n: float, n_exp: float, kinds) -> dict:
        """weights, gradients, optimizer states and ZeRO-3 gather buffers of one rank (bytes).
        ``n``: parameter elements it holds (experts split by ep), ``n_exp`` of which experts."""
        p = self.precision
        d = lay.dp * lay.cp
        muon = sum(self.muon_state_saving(k, lay) for k in kinds)
        zl, local = self._zero_layout(lay, part, s2r, rank)
        ew, eg, eo = (0.0, 0.0, 0.0) if local else self.static_per_elem(lay.zero, self.expert_replicas(lay))
        experts = {"weights": ew * n_exp, "gradients": eg * n_exp, "optimizer": eo * n_exp}
        if zl is not None:  # ZeRO-2/3, laid out as the runtime does (padding, resident group)
            pb = zl.parameter_bytes(p.weight)
            if lay.zero == 3:
                weights, optim = pb["master shards"] + pb["resident"], p.adam * zl.shard_numel
            else:
                weights, optim = pb["whole parameters"], p.adam * zl.shard_numel + pb["master shards"]
            return {"weights": weights + experts["weights"],
                    "gradients": zl.gradient_bytes() + experts["gradients"],
                    "optimizer": optim + experts["optimizer"] - muon, "zero-3 gather": pb.get("gather buffers", 0)}
        plain = n - n_exp
        if lay.zero >= 2 and d > 1:  # a profile without parameter names: per element, no padding
            row = {"weights": p.weight * (plain / d if lay.zero == 3 else plain),
                   "gradients": self.grad_per_param(lay) * plain, "optimizer": self.optim_per_param(lay) * plain / d,
                   "zero-3 gather": 2 * max((self.unit_weight_bytes(k, lay) for k in kinds), default=0.0)
                   if lay.zero == 3 else 0.0}
        else:
            row = {"weights": p.weight * plain, "gradients": self.grad_per_param(lay) * plain,
                   "optimizer": self.optim_per_param(lay) * (plain / d if lay.zero >= 1 else plain),
                   "zero-3 gather": 0.0}
        row["optimizer"] -= muon
        return {k: v + experts.get(k, 0.0) for k, v in row.items()}


# the ZeRO layout takes expert shards over their own replicas (autopar.parallel.zero_layout)
_ZL_EXPERTS = "expert_replicas" in inspect.signature(zero_layout).parameters


@lru_cache(maxsize=None)
def divisors(n: int) -> tuple[int, ...]:
    return tuple(x for x in range(1, n + 1) if n % x == 0)
