"""Predicted step time of one candidate plan (the time part of planner/estimate.py's
``Evaluator``).

Each stage's F, I and W are the sums of its units' times (roofline per node); CP adds the
Ulysses all-to-alls around each attention to F and I (with the key/value head copies a
grouped-query attention needs beyond its key/value heads), EP the token dispatch/combine around
each MoE, ZeRO-3 the parameter all-gather of every F and I, overlapped with the unit's compute (a
unit takes the longer of the two; on the cpu profile, where gloo shares the cores, the sum).
The schedule is replayed by the simulator with these per-stage costs and the P2P transfer
time of each stage boundary. Per stage the runtime adds: stage 0's I is empty (its W does the
whole backward), every W/B accumulates its gradients into ``.grad`` (a linear layer's inside
its weight-gradient GEMM), and on the cpu profile every cross-rank message costs the rank
compute time. After the pipeline, in the runtime's order (:meth:`TimeModel.after_pipeline`):
tied weights summed over the pipeline ranks holding them, the data-parallel reduction
(ZeRO-0: started when a stage's last W/B ran, overlapped only with the rank's later actions;
ZeRO-1: reduce-scatter and all-gather inside the optimizer step, not overlapped; ZeRO-2/3: one
reduce-scatter per layer group after its last W, ZeRO-2's all-gather after the step), then the
optimizer step (memory-bound, torch's Adam passes; Muon's Newton-Schulz GEMMs). ``step =
makespan + dp_exposed + optimizer``. On the ``cpu`` profile units are priced from their
measured programs (``UnitKind.times``) and gloo's collectives, P2P under load and shared memory
bandwidth use the measured constants below.
"""
from __future__ import annotations

from autopar.schedules import build
from autopar.schedules.costs import Costs

from . import comm
from .inflight import fixed_schedule
from .layout import Layout, Partition
from .profile import UnitKind

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


class TimeModel:
    """The time terms of ``Evaluator`` (planner/estimate.py), which mixes this in."""

    def scale(self, lay: Layout) -> float:
        return lay.b / self.profile.batch0 / lay.cp

    def links(self, lay: Layout):
        """The link class of each axis's groups: tp is the innermost axis (its ranks adjacent),
        every other group's members are ``tp`` times further apart than without it."""
        key = (lay.pp, lay.dp, lay.cp, lay.ep, lay.tp)
        hit = self._links.get(key)
        if hit is None:
            d, t = self.device, lay.tp
            hit = self._links[key] = {
                "cp": comm.group_link(d, lay.cp, t), "dp": comm.group_link(d, lay.dp * lay.cp, t),
                "pp": comm.group_link(d, lay.pp, lay.dp * lay.cp * t), "tp": comm.group_link(d, t, 1)}
            slot = self._ep_stride(lay)
            hit.update(ep=comm.group_link(d, lay.ep, slot),
                       edp=comm.group_link(d, self.expert_replicas(lay), lay.ep * slot))
        return hit

    def ep_all_to_all(self, nbytes: float, lay: Layout) -> float:
        """One expert-parallel all-to-all of ``nbytes`` per rank, its intra- and inter-node parts
        apart (``comm.group_all_to_all_time``; the ep group's slots are consecutive ranks when
        folded over tp, else tp apart); on the ``cpu`` profile gloo's all-to-all over one link."""
        if self.device.name == "cpu":
            return comm.all_to_all_time(nbytes, lay.ep, self.links(lay)["ep"])
        return comm.group_all_to_all_time(self.device, nbytes, lay.ep, self._ep_stride(lay))

    def _ep_stride(self, lay: Layout) -> int:
        """Global ranks between consecutive members of an ep group: its slots are consecutive
        ranks when folded over tp, else the same tp rank of consecutive replicas, tp apart."""
        return 1 if self.fold(lay) > 1 else lay.tp

    @staticmethod
    def _time_key(kind: UnitKind, lay: Layout) -> tuple:
        return id(kind), lay.b, lay.cp, lay.ep, lay.dp if lay.zero == 3 else 0, lay.zero == 3, lay.tp

    def unit_times(self, kind: UnitKind, lay: Layout) -> tuple[float, float, float]:
        key = self._time_key(kind, lay)
        hit = self._times.get(key)
        if hit is not None:
            return hit
        sc = self.scale(lay)
        f, i, w = kind.times(self.device, sc, lay.ep)
        links = self.links(lay)
        n_red, red_bytes, tp = kind.tp_comm
        if tp > 1:
            # passes/tensor_parallel.py: the row linears' sums in F, the column inputs' gradients
            # in I, each an all-reduce over the tp group the op waits for (no overlap yet); with
            # sequence parallelism (passes/sequence_parallel.py) a reduce-scatter per row sum and
            # an all-gather per column input in F, the reverse of each in I (ring: the same time),
            # and in I each column input all-gathered again for its weight gradient
            n_rs, rs_bytes, n_ag, ag_bytes = kind.sp_comm
            t = sum(n * self.collective(op, nbytes / n * sc, tp, links["tp"])
                    for op, n, nbytes in (("all_reduce", n_red, red_bytes), ("reduce_scatter", n_rs, rs_bytes),
                                          ("all_gather", n_ag, ag_bytes)) if n)
            again = n_ag * self.collective("all_gather", ag_bytes / n_ag * sc, tp, links["tp"]) if n_ag else 0.0
            f, i = f + t, i + t + again
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
            fold = self.fold(lay)
            if fold > 1:
                # experts folded over the tp ranks: each routes 1/tp of the replica's rows, so its
                # experts' GEMMs (F, I, and W's 3/2: passes/moe_dispatch.dispatch_flops) shrink by
                # that, and the blocks' outputs are all-gathered over tp in F (their gradients in I)
                mine = (1.0 - 1.0 / fold) * r.rows * sc * r.flops_per_row / rate
                gather = self.collective("all_gather", r.token_bytes * sc, fold, links["tp"])
                f, i, w = f - mine + gather, i - mine + gather, w - 1.5 * mine
            rows = r.rows / fold
            one = self.ep_all_to_all(rows * sc * imb * r.row_bytes, lay)
            # passes/moe_overlap.py: each all-to-all flies while the independent work of its
            # window (a shared expert; its input gradients in I) computes: only the rest is exposed
            a2a_f = sum(max(0.0, one - h * sc / rate) for h in r.overlap_f)
            a2a_i = sum(max(0.0, one - h * sc / rate) for h in r.overlap_i)
            self._dispatch[key] = (a2a_f, a2a_i)
            extra = (imb - 1.0) * rows * sc * r.flops_per_row / rate
            f, i, w = f + a2a_f + extra, i + a2a_i + extra, w + extra
        elif lay.ep > 1 and kind.dispatch_bytes:  # static capacity: the whole expert buffers move
            a2a = 2 * self.ep_all_to_all(kind.dispatch_bytes * sc, lay)
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

    def message_bytes(self, lay: Layout, part: Partition) -> tuple[float, ...]:
        b = part.bounds
        return tuple(self.units[b[s + 1] - 1].kind.out_bytes * self.scale(lay) for s in range(len(b) - 2))

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
        # from the simulation: when each rank's last action ended, (end, duration) of its last
        # I/W/B, and when each stage's last W/B ended
        end, last_bwd = sim.ends, sim.last_backward
        done = {s: t for s, t in enumerate(sim.stage_done) if t > 0.0}
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
