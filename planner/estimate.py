"""Predicted step time and per-rank memory of one candidate plan (degrees + schedule +
microbatching + stage boundaries + recompute), from a ModelProfile and a DeviceProfile.

Time: each stage's F, I and W are the sums of its units' times (roofline per node); CP adds the
Ulysses all-to-alls around each attention to F and I, EP the token dispatch/combine around each
MoE, ZeRO-3 the parameter all-gathers and gradient reduce-scatters, overlapped with the unit's
compute (a unit takes the longer of the two). The schedule is replayed by the simulator with
these per-stage costs and the P2P transfer time of each stage boundary. After the pipeline,
the data-parallel gradient reduction is overlapped with the rank's last backward (only the
excess shows), then the optimizer step (memory-bound) and, for ZeRO-1/2, the all-gather of the
updated parameters. ``step = makespan + dp_exposed + optimizer``.

Memory, per rank, the heaviest rank decides:
  parameters, gradients and optimizer states (sharded over dp*cp by the ZeRO level; expert
  weights split over ep; a parameter several units share, e.g. a tied embedding/head, once
  per rank), the saved activations at the schedule's peak (walking each rank's actions in
  order: F adds what the stage saves, I changes it to what W still needs, which includes the
  values I computes for W and can be MORE than F saved, W frees the rest, B frees all), the largest transient working set of one unit, the
  gradient outputs of one stage's backward (the W/B program returns every parameter gradient
  of the stage before the runtime adds them into ``.grad``, so during a W/B a second,
  per-microbatch copy of the stage's gradients is live), P2P buffers (the runtime keeps every
  sent tensor until the end of the step: m per boundary and direction, plus two receive
  buffers in flight), DP bucket buffers, ZeRO-3 gather buffers, and a fixed runtime overhead.
Rank layout: cp varies fastest, then dp, then pp (so cp and dp groups stay inside a node when
they can); ep groups are drawn from the dp*cp ranks of one stage.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

from autopar.schedules import build, simulate
from autopar.schedules.costs import Costs

from . import comm
from .profile import ModelProfile, UnitKind

GiB = 1024 ** 3


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

    @property
    def num_stages(self) -> int:
        return self.pp * self.v

    @property
    def world(self) -> int:
        return self.pp * self.dp * self.cp

    def label(self) -> str:
        return (f"pp={self.pp} dp={self.dp} cp={self.cp} ep={self.ep} {self.schedule} v={self.v} "
                f"m={self.m} b={self.b} zero={self.zero}")


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


@dataclass(frozen=True)
class Precision:
    """Bytes per parameter element: weights, gradients (fp32 accumulation), optimizer states (Adam)."""

    name: str
    weight: int
    grad: int
    optim: int   # Adam m + v (+ fp32 master weights in mixed precision)

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
                 bucket_bytes: float = 25 * 2 ** 20):
        self.profile = profile
        self.device = device
        self.memory_limit = float(memory_limit)
        self.global_batch = global_batch
        self.bucket_bytes = bucket_bytes
        self.precision = Precision.for_profile(profile)
        self.units = profile.units
        self._times: dict = {}
        self._sims: dict = {}   # identical pipelines (e.g. ZeRO 0/1/2 of one layout) simulate once

    # ------------------------------------------------------------------ per-unit quantities
    def scale(self, lay: Layout) -> float:
        return lay.b / self.profile.batch0 / lay.cp

    def links(self, lay: Layout):
        d = self.device
        return {"cp": comm.group_link(d, lay.cp, 1), "dp": comm.group_link(d, lay.dp * lay.cp, 1),
                "ep": comm.group_link(d, lay.ep, 1), "pp": comm.group_link(d, lay.pp, lay.dp * lay.cp)}

    def unit_times(self, kind: UnitKind, lay: Layout) -> tuple[float, float, float]:
        key = (id(kind), lay.b, lay.cp, lay.ep, lay.dp if lay.zero == 3 else 0, lay.zero == 3)
        hit = self._times.get(key)
        if hit is not None:
            return hit
        sc = self.scale(lay)
        f, i, w = kind.times(self.device, sc)
        links = self.links(lay)
        if lay.cp > 1 and kind.attention_bytes:
            a2a = comm.all_to_all_time(kind.attention_bytes * sc, lay.cp, links["cp"])
            f, i = f + a2a, i + a2a
        if lay.ep > 1 and kind.dispatch_bytes:
            a2a = 2 * comm.all_to_all_time(kind.dispatch_bytes * sc, lay.ep, links["ep"])
            f, i = f + a2a, i + a2a
        if lay.zero == 3 and lay.dp * lay.cp > 1:
            d = lay.dp * lay.cp
            gather = comm.all_gather_time(self.unit_weight_bytes(kind, lay), d, links["dp"])
            scatter = comm.reduce_scatter_time(self.unit_grad_bytes(kind, lay), d, links["dp"])
            f = max(f, gather)
            w = max(w, gather + scatter - i)
        self._times[key] = (f, i, w)
        return self._times[key]

    def unit_params(self, kind: UnitKind, lay: Layout) -> float:
        """Parameter elements of a unit held by one rank before ZeRO sharding (experts split by ep)."""
        return (kind.params - kind.expert_params) + kind.expert_params / lay.ep

    def unit_weight_bytes(self, kind: UnitKind, lay: Layout) -> float:
        return self.unit_params(kind, lay) * self.precision.weight

    def unit_grad_bytes(self, kind: UnitKind, lay: Layout) -> float:
        return self.unit_params(kind, lay) * self.precision.grad

    def unit_static(self, kind: UnitKind, lay: Layout) -> float:
        """Parameter + gradient + optimizer bytes of one unit on one rank, after ZeRO sharding."""
        n = self.unit_params(kind, lay)
        d = lay.dp * lay.cp
        p = self.precision
        w = p.weight * (n / d if lay.zero >= 3 else n)
        g = p.grad * (n / d if lay.zero >= 2 else n)
        o = p.optim * (n / d if lay.zero >= 1 else n)
        return w + g + o

    def unit_saved(self, kind: UnitKind, lay: Layout, recompute: bool) -> float:
        sc = self.scale(lay)
        return (kind.in_bytes if recompute else kind.saved_bytes) * sc

    # ------------------------------------------------------------------ stages
    def stage_kinds(self, part: Partition) -> list[list[UnitKind]]:
        b = part.bounds
        return [[u.kind for u in self.units[b[s]:b[s + 1]]] for s in range(len(b) - 1)]

    def stage_costs(self, lay: Layout, part: Partition) -> Costs:
        f, i, w = [], [], []
        for kinds, rc in zip(self.stage_kinds(part), part.recompute):
            tf = ti = tw = 0.0
            for k in kinds:
                a, bb, c = self.unit_times(k, lay)
                tf, ti, tw = tf + a, ti + bb, tw + c
            if rc:
                ti += tf  # I replays the forward first
            f.append(max(tf, 1e-12))
            i.append(max(ti, 1e-12))
            w.append(max(tw, 1e-12))
        return Costs(f=tuple(f), i=tuple(i), w=tuple(w))

    def stage_bytes(self, lay: Layout, part: Partition) -> tuple[float, ...]:
        out = []
        for kinds, rc in zip(self.stage_kinds(part), part.recompute):
            if rc:
                out.append(kinds[0].in_bytes * self.scale(lay))
            else:
                out.append(sum(k.saved_bytes for k in kinds) * self.scale(lay))
        return tuple(max(x, 1.0) for x in out)  # >= 1 byte: zb-auto divides by it

    def i_free_fraction(self, part: Partition) -> float:
        """Share of a stage's saved bytes released by I (the smallest over stages: conservative)."""
        fr = []
        for kinds, rc in zip(self.stage_kinds(part), part.recompute):
            saved = sum(k.saved_bytes for k in kinds)
            after = sum(k.saved_after_i for k in kinds)
            fr.append(0.0 if rc or saved <= 0 else max(0.0, 1.0 - after / saved))
        return min(fr) if fr else 0.5

    def activation_peaks(self, sched, lay: Layout, part: Partition) -> tuple[float, ...]:
        """Per-rank peak of saved activations over the schedule's action order (bytes).

        Like ``schedules.simulate.peak_memory`` with per-stage amounts, except that I may add
        memory: after I a microbatch holds what W reads (``saved_after_i``), the saved values
        plus what I computed for W, which can exceed what F saved. A recomputing stage keeps
        only its input until I, and its I/W pair is counted as keeping that."""
        from autopar.schedules.ir import B, F, I, W

        sc = self.scale(lay)
        after_f, after_i = [], []
        for kinds, rc in zip(self.stage_kinds(part), part.recompute):
            if rc:
                a = kinds[0].in_bytes * sc
                after_f.append(a)
                after_i.append(a)
            else:
                after_f.append(sum(k.saved_bytes for k in kinds) * sc)
                after_i.append(sum(k.saved_after_i for k in kinds) * sc)
        peaks = []
        for acts in sched.actions:
            mem = peak = 0.0
            for a in acts:
                s = a.stage
                if a.type == F:
                    mem += after_f[s]
                elif a.type == I:
                    mem += after_i[s] - after_f[s]
                elif a.type == W:
                    mem -= after_i[s]
                elif a.type == B:
                    mem -= after_f[s]
                peak = max(peak, mem)
            peaks.append(peak)
        return tuple(peaks)

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
        return build(lay.schedule, lay.pp, lay.m, lay.v)

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
        return (p.weight / (d if lay.zero >= 3 else 1) + p.grad / (d if lay.zero >= 2 else 1)
                + p.optim / (d if lay.zero >= 1 else 1))

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
        """The largest set of parameter gradients one W/B program of this rank returns at once
        (one stage's, in the parameters' dtype), live beside ``.grad`` until accumulated."""
        kinds = self.stage_kinds(part)
        best = 0.0
        for s in range(len(s2r)):
            if s2r[s] == rank:
                n = sum(self.unit_params(k, lay) for k in kinds[s]) - self.shared_duplicates(part, [s])
                best = max(best, n * self.precision.weight)
        return best

    def p2p_bytes(self, lay: Layout, part: Partition, s2r, rank: int) -> float:
        """Sent tensors the runtime holds until the end of the step (each stage boundary that
        crosses ranks: m activations forward, m gradients back) plus two receive buffers."""
        if lay.pp == 1:
            return 0.0
        sc = self.scale(lay)
        b = part.bounds
        S = len(b) - 1
        held = recv = 0.0
        for s in range(S):
            if s2r[s] != rank:
                continue
            if s + 1 < S and s2r[s + 1] != rank:   # sends activations forward, receives their gradients
                out = self.units[b[s + 1] - 1].kind.out_bytes * sc
                held += lay.m * out
                recv = max(recv, out)
            if s > 0 and s2r[s - 1] != rank:       # receives activations, sends their gradients back
                inp = self.units[b[s]].kind.in_bytes * sc
                held += lay.m * inp
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
        key = (id(sched), costs, msg, links["pp"], sb, frac)
        sim = self._sims.get(key)
        if sim is None:
            sim = simulate(sched, costs, p2p_latency=links["pp"].alpha_s, p2p_bandwidth=links["pp"].bandwidth,
                           message_bytes=msg, stage_bytes=sb, i_free_fraction=frac)
            self._sims[key] = sim
        memory, peaks = self.memory(lay, part, s2r, self.activation_peaks(sched, lay, part))
        # DP: gradient reduction overlapped with the rank's last backward; ZeRO-1/2 gather after the step
        d = lay.dp * lay.cp
        dp_exposed = 0.0
        opt = 0.0
        p = self.precision
        for r in range(lay.pp):
            stages = [s for s in range(len(s2r)) if s2r[s] == r]
            kinds = [k for s in stages for k in self.stage_kinds(part)[s]]
            n = self.rank_params(lay, part, s2r, r)
            tensors = sum(k.param_tensors for k in kinds)
            last_bwd = sum(costs.i[s] + costs.w[s] for s in stages)
            exposed = 0.0
            if d > 1 and lay.zero < 3:
                if lay.zero == 0:
                    red = comm.all_reduce_time(n * p.grad, d, links["dp"])
                else:
                    red = comm.reduce_scatter_time(n * p.grad, d, links["dp"])
                exposed = max(0.0, red - last_bwd)
                if lay.zero >= 1:
                    exposed += comm.all_gather_time(n * p.weight, d, links["dp"])
            dp_exposed = max(dp_exposed, exposed)
            shard = n / d if (lay.zero >= 1 and d > 1) else n
            moved = shard * (p.weight + p.grad + p.optim) * 2
            ov = self.device.op_overhead_s * tensors * 12
            bw = self.device.mem_bandwidth * self.device.mem_efficiency
            opt = max(opt, moved / bw + ov)
        est = Estimate(layout=lay, partition=part, stage_to_rank=tuple(s2r), stage_costs=costs,
                       makespan_s=sim.makespan, dp_exposed_s=dp_exposed, optimizer_s=opt,
                       bubble=sim.bubble_fraction, peak_memory=tuple(peaks), memory=tuple(memory),
                       memory_limit=self.memory_limit, message_bytes=msg,
                       p2p_link=(links["pp"].alpha_s, links["pp"].bandwidth), schedule_obj=sched)
        tokens = self.global_batch * (self.profile.seq_len or 1)
        est.tokens_per_s = tokens / est.step_time
        flops = self.profile.flops_per_sample() * self.global_batch
        peak = self.device.flops_rate("bfloat16" if p.weight == 2 else "float32") / self.device.flops_efficiency
        est.mfu = flops / (est.step_time * lay.world * peak)
        return est

    def peak_memory_only(self, lay: Layout, part: Partition) -> list[float]:
        """Per-rank peak bytes of a fixed-order schedule, without timing it."""
        sched = build(lay.schedule, lay.pp, lay.m, lay.v)
        return self.memory(lay, part, sched.stage_to_rank, self.activation_peaks(sched, lay, part))[1]

    def memory(self, lay: Layout, part: Partition, s2r, act_peaks) -> tuple[list[dict], list[float]]:
        """Per-rank components (bytes) and totals; ``act_peaks`` from the simulator (bytes)."""
        sc = self.scale(lay)
        p = self.precision
        d = lay.dp * lay.cp
        rows, totals = [], []
        stage_kinds = self.stage_kinds(part)
        for r in range(lay.pp):
            kinds = [k for s in range(len(s2r)) if s2r[s] == r for k in stage_kinds[s]]
            n = self.rank_params(lay, part, s2r, r)
            row = {
                "weights": p.weight * (n / d if lay.zero >= 3 else n),
                "gradients": p.grad * (n / d if lay.zero >= 2 else n),
                "optimizer": p.optim * (n / d if lay.zero >= 1 else n),
                "activations": float(act_peaks[r]),
                "working": max((k.work_bytes for k in kinds), default=0.0) * sc,
                "grad outputs": self.grad_output_bytes(lay, part, s2r, r),
                "p2p buffers": self.p2p_bytes(lay, part, s2r, r),
                "dp buckets": min(2 * self.bucket_bytes, n * p.grad) if (d > 1 and lay.zero == 0) else 0.0,
                "zero-3 gather": 2 * max((self.unit_weight_bytes(k, lay) for k in kinds), default=0.0)
                if lay.zero >= 3 and d > 1 else 0.0,
                "runtime": runtime_overhead(self.device),
            }
            rows.append(row)
            totals.append(sum(row.values()))
        return rows, totals


@lru_cache(maxsize=None)
def divisors(n: int) -> tuple[int, ...]:
    return tuple(x for x in range(1, n + 1) if n % x == 0)
