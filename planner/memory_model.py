"""Predicted per-rank memory of one candidate plan (the memory part of planner/estimate.py's
``Evaluator``); the heaviest rank decides.

Per pipeline rank: parameters, gradients and optimizer states (sharded over dp*cp by the ZeRO
level; ZeRO-2/3 exactly as ``autopar.passes.zero_layout`` lays them out, padding, resident
group and gather buffers included; expert weights split over ep, and their ZeRO shards taken over
their expert-data-parallel group, dp*cp/ep; a parameter several units share, e.g. a tied
embedding/head, once per rank), the saved activations at the schedule's peak (walking each
rank's actions in order, planner/inflight.py: F adds what the stage saves, I changes it to what
W still needs, which includes the values I computes for W and can be MORE than F saved, W frees
the rest, B frees all; a routed MoE's received rows at the worst rank's imbalance), the largest
transient working set of one unit, under ZeRO-2/3 the fresh gradients one W/B returns before
they are added into the flat buffers (ZeRO-0/1 programs accumulate into ``.grad`` in place and
return none), P2P buffers (a send is held until a later message from its receiver proves it
arrived: per boundary the sending stage's microbatches in flight plus one, and two receive
buffers), the gradient-reduction buffers (DP buckets, ZeRO-1's flat gradients and gathered
parameters; the runtime allocates them after a stage's last backward, so only their excess over
the pipeline phase's activations and transients counts), and a fixed runtime overhead. An
activation offload moves part of the saved activations to the host (planner/offload_model.py).
Rank layout: cp varies fastest, then dp, then pp (so cp and dp groups stay inside a node when
they can); ep groups are drawn from the dp*cp ranks of one stage.
"""
from __future__ import annotations

import inspect
import math

from autopar.passes.zero_layout import (
    MASTER_BYTES,
    ParamSpec,
    ZeroLayout,
    aligned_offsets,
    layer_group,
    ns_flops,
    zero_layout,
)
from autopar.plan import expert_slots
from autopar.schedules.simulate import peak_memory

from .inflight import frontier_peaks, inflight_frontier, stage_inflight
from .layout import GiB, Layout, Partition
from .profile import UnitKind

# Default max/mean ratio of the rows an expert-parallel rank receives in a dropless MoE
# dispatch: the capacity factor 1.25 that Switch Transformers (Fedus et al. 2021,
# arXiv:2101.03961, section 2.2 and Table 1) and GShard (Lepikhin et al. 2020,
# arXiv:2006.16668) train with as headroom for routing imbalance; ``--moe-imbalance`` sets it.
DEFAULT_MOE_IMBALANCE = 1.25

# the ZeRO layout takes expert shards over their own replicas (autopar.passes.zero_layout)
_ZL_EXPERTS = "expert_replicas" in inspect.signature(zero_layout).parameters


def runtime_overhead(device) -> float:
    """Fixed per-process memory outside tensors the planner sees: CUDA context, NCCL buffers,
    allocator slack. The cpu profile measures live tensor bytes, so nothing is added there."""
    return 0.0 if device.name == "cpu" else 2.0 * GiB


class MemoryModel:
    """The memory terms of ``Evaluator`` (planner/estimate.py), which mixes this in."""

    def expert_replicas(self, lay: Layout) -> int:
        """Ranks holding the same experts (the expert-data-parallel group): dp*cp/ep, or
        dp*cp*tp/ep with the experts folded over the tp ranks (``autopar.plan.expert_slots``)."""
        return max(1, expert_slots(lay.dp, lay.cp, lay.tp, lay.ep) // lay.ep)

    @staticmethod
    def fold(lay: Layout) -> int:
        """The tp ranks that split a replica's routed rows (experts folded over them,
        ``autopar.plan.expert_slots``; runtime/mesh.py), else 1."""
        return expert_slots(lay.dp, lay.cp, lay.tp, lay.ep) // (lay.dp * lay.cp)

    def routed(self, kind: UnitKind, lay: Layout) -> tuple[float, float]:
        """(mean, worst rank) bytes the unit's token-proportional MoE dispatch keeps from F to W
        per microbatch on one rank: the received rows and the experts' saved activations. The
        worst rank receives ``moe_imbalance`` times the mean under expert parallelism; a rank
        holding every expert (ep = 1) gets exactly the routed rows. (0, 0) without a routed MoE."""
        r = kind.routed
        if r is None:
            return 0.0, 0.0
        mean = r.rows * self.scale(lay) * r.saved_row_bytes / self.fold(lay)
        return mean, mean * (self.moe_imbalance if lay.ep > 1 else 1.0)

    def unit_saved(self, kind: UnitKind, lay: Layout) -> tuple[float, float]:
        """(after F, after I) bytes one microbatch of the unit keeps, routed MoE imbalance included
        (the capture holds the mean routed rows; the worst rank keeps ``moe_imbalance`` times them),
        and the key/value head copies context parallelism adds until I (``kv_copies_bytes``)."""
        sc = self.scale(lay)
        mean, worst = self.routed(kind, lay)
        copies = kind.kv_copies_bytes(lay.cp) * sc
        return kind.saved_bytes * sc + worst - mean + copies, kind.saved_after_i * sc + worst - mean

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
        the matrices of its own shard (passes/zero_layout.aligned_offsets: about 1/R of
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

    def stage_kinds(self, part: Partition) -> list[list[UnitKind]]:
        b = part.bounds
        return [[u.kind for u in self.units[b[s]:b[s + 1]]] for s in range(len(b) - 1)]

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
        builds it (autopar.passes.zero_layout); None without ZeRO-2/3 over replicas or when
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

    def muon_dealt(self, lay: Layout, part: Partition, s2r, rank: int) -> tuple[float, float] | None:
        """Under ``optimizer="muon"`` and ZeRO >= 1: how the runtime deals ``rank``'s Muon
        matrices whole to the replicas (passes/zero_layout.aligned_offsets: ZeRO-1 and ZeRO-2
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
