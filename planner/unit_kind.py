"""One distinct unit graph as the planner prices it (``UnitKind``: its F, I and W programs,
what F keeps, its parameters, its tensor-parallel shares, its dropless MoE dispatch, its
remaking variant) and one unit of the model (``Unit``: a kind at a place). Built by
planner/profile.py."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable

from autopar.passes.cp_rules import kv_repeats

from .programs import Program
from .routed import RoutedInfo
from .tp_share import TpShare


@dataclass(frozen=True)
class UnitKind:
    """Costs of one distinct unit graph, per captured microbatch (``ModelProfile.batch0`` samples)."""

    kind: str                 # signature label, e.g. "layers.0"
    f: Program
    i: Program
    w: Program
    saved_bytes: float        # F keeps for I and W
    saved_after_i: float      # what W still needs after I ran; may exceed saved_bytes (I's outputs W reads)
    in_bytes: float           # activations received (what a recomputing stage keeps)
    out_bytes: float          # activations sent to the next unit
    params: int               # parameter elements
    param_tensors: int        # parameter tensors (the optimizer's per-tensor work)
    param_bytes: int
    expert_params: int        # of which expert weights (sharded by EP)
    attention_bytes: float    # q, k, v and output of every attention (Ulysses all-to-all volume at cp | all heads)
    dispatch_bytes: float     # MoE tokens dispatched to experts (EP all-to-all volume; dropless: the mean routed rows)
    work_bytes: float         # largest live set of intermediate activations (backward or forward), no param grads
    small_params: int = 0     # elements of non-expert parameters with < 2 dims (norms, biases: ZeRO-3's resident group)
    # the unit's token-proportional (dropless) MoE dispatch, per captured microbatch; None: no
    # routed MoE (a static-capacity MoE is priced by ``dispatch_bytes``)
    routed: "RoutedInfo | None" = None
    # times the unit's F, I and W programs on real tensors in this process: (f, i, w) seconds at
    # the captured microbatch; None for models captured on fake tensors (meta presets)
    measure: Callable[[], tuple[float, float, float]] | None = field(default=None, compare=False, repr=False)
    # the chunked cross-entropy's buffers inside its ops, which no graph value shows
    # (autopar/linear_ce.working_bytes_per_token): bytes per token of one chunk, the chunk, and the loss's
    # tokens at the captured microbatch (a microbatch with fewer tokens than a chunk holds fewer)
    loss_chunk_row_bytes: float = 0.0
    loss_chunk: int = 0
    loss_tokens: int = 0
    loss_fixed_bytes: float = 0.0  # its weight gradient's [vocab, d] temporaries
    # of ``saved_bytes``, what only W reads (an activation offload keeps it on the host through I)
    saved_w_only: float = 0.0
    # the parameters autopar.Muon steps (passes/optimizer_routing.py: the hidden matrices), their
    # elements and one step's Newton-Schulz FLOPs (passes/zero_layout.ns_flops), the expert
    # weights' part of each apart (split by ep)
    muon_params: int = 0
    muon_expert_params: int = 0
    muon_flops: float = 0.0
    muon_expert_flops: float = 0.0
    # (key/value heads, k + v bytes) of each grouped-query SDPA: cp beyond its key/value heads
    # sends repeated copies (passes/context_parallel.kv_repeats)
    grouped_kv: tuple[tuple[int, float], ...] = ()
    tp_shares: tuple[TpShare, ...] = ()  # per searched tp degree; () where nothing shards
    # under tensor parallelism (``at_tp``): the factor on F/I/W times, (all-reduces per forward,
    # their bytes summed, tp) and (reduce-scatters, bytes, all-gathers, bytes) of sequence
    # parallelism; the backward runs as many of each (the reverse collective), in I
    time_scale: float = 1.0
    tp_comm: tuple[int, float, int] = (0, 0.0, 1)
    sp_comm: tuple[int, float, int, float] = (0, 0, 0, 0.0)
    # the same unit with its backward making element-wise values again (``Plan.remake``,
    # passes/split_backward.py): its I and W programs and what F keeps; None where the profile
    # already holds that form (compiled plans remake) or the unit has no backward of its own
    remade: "UnitKind | None" = field(default=None, compare=False, repr=False)
    # the programs ``measure`` times when they are not this kind's own (a remade variant is
    # timed as its plain unit's measurement times the roofline ratio of the two)
    measured_as: "tuple[Program, Program, Program] | None" = field(default=None, compare=False, repr=False)

    def tp_share(self, tp: int) -> "TpShare | None":
        return next((s for s in self.tp_shares if s.tp == tp), None)

    def remaking(self) -> "UnitKind":
        """This unit as a stage that makes element-wise values again runs it (``remade``; itself
        where there is no such variant), priced from the same measurement when timed."""
        if self.remade is None:
            return self
        return replace(self.remade, measure=self.measure, measured_as=(self.f, self.i, self.w), remade=None)

    def at_tp(self, tp: int) -> "UnitKind":
        """This unit on one rank of a tp group: sharded parameters, activations and FLOPs divided
        by tp, the all-reduces added (``TpShare``); itself where nothing shards at ``tp``."""
        sh = self.tp_share(tp)
        if sh is None:
            return self
        cut = sh.activations + sh.sequence
        keep = 1.0 - cut + cut / tp
        after_i = keep + sh.regathered * (1.0 - 1.0 / tp)  # W reads the column inputs I gathered again
        b_in, b_out = (1.0 - b + b / tp for b in sh.boundary)
        (n_rs, rs_bytes), (n_ag, ag_bytes) = sh.scatters, sh.gathers
        return replace(self, params=self.params - sh.params + sh.params // tp,
                       param_bytes=self.param_bytes - sh.param_bytes + sh.param_bytes // tp,
                       saved_bytes=self.saved_bytes * keep, saved_after_i=self.saved_after_i * after_i,
                       saved_w_only=self.saved_w_only * keep, work_bytes=self.work_bytes * keep,
                       in_bytes=self.in_bytes * b_in, out_bytes=self.out_bytes * b_out,
                       attention_bytes=self.attention_bytes / tp if sh.attention else self.attention_bytes,
                       time_scale=1.0 - sh.flops + sh.flops / tp,
                       tp_comm=(sh.reduces - n_rs, sh.reduce_bytes - rs_bytes, tp),
                       sp_comm=(n_rs, rs_bytes, n_ag, ag_bytes), tp_shares=(),
                       # Muon's momentum is held per block; its Newton-Schulz runs on the whole
                       # matrix on every tp rank (gathered: autopar/muon.py), so its FLOPs stay
                       muon_params=self.muon_params - min(sh.params, self.muon_params - self.muon_expert_params)
                       * (1 - 1 / tp),
                       # a vocabulary-parallel chunked loss: each rank's chunk holds its classes only
                       loss_chunk_row_bytes=self.loss_chunk_row_bytes / tp if sh.params else self.loss_chunk_row_bytes,
                       loss_fixed_bytes=self.loss_fixed_bytes / tp if sh.params else self.loss_fixed_bytes,
                       remade=self.remade.at_tp(tp) if self.remade is not None else None)

    def kv_copies_bytes(self, cp: int) -> float:
        """Bytes of the key/value head copies context parallelism at ``cp`` adds (per captured
        microbatch, before the 1/cp of a rank): they go through the all-to-all, and the attention
        keeps them for its backward."""
        return sum(b * (kv_repeats(h, cp) - 1) for h, b in self.grouped_kv)

    def work(self, scale: float) -> float:
        """The transient working set at ``scale`` times the captured microbatch."""
        return (self.work_bytes * scale + min(self.loss_chunk, self.loss_tokens * scale) * self.loss_chunk_row_bytes
                + self.loss_fixed_bytes)

    def times(self, device, scale: float, ep: int = 1) -> tuple[float, float, float]:
        """(F, I, W) seconds on ``device`` at ``scale`` times the captured microbatch, on a rank
        of an expert-parallel group of ``ep`` (it reads and writes 1/ep of the expert weights:
        ``Program.expert_bytes``).

        On the measured ``cpu`` profile (this machine) a unit captured on real tensors is
        priced from its own programs, timed here on first use (``UnitTimer``: every distinct
        unit round-robin, median of up to 15 runs, one thread, as the runtime runs them) at the
        captured microbatch and at a second size (half of it, or twice it below 4 samples, from
        a second capture): each program costs the line through both points, a fixed part plus
        a per-sample part scaled by ``scale``. With one size only (the second capture did not
        cut into the same units), the fixed part is the profile's per-node overhead times the
        node count. The roofline (``Program.time``) is kept for every other device and for
        fake-tensor captures. Why measure: at a microbatch's shapes on one CPU core, GEMMs of
        a few hundred tokens, GELU's erf, layer norm and the CPU flash-attention kernel run far
        below the microbenchmark's peak matmul rate and streaming bandwidth (examples/gpt, 4
        blocks x 128 tokens, d_model 128: F measured 6.6 ms, roofline 3.2 ms; W 13.0 ms vs
        6.4 ms). Why two sizes: the fixed cost per node of these programs is ~20 us, not the
        3-7 us the profile's 8-element microbenchmark measures (stage of 4 blocks + embeddings,
        152 nodes, F at 1/2/4/8 samples: 6.1/8.5/12.7/24.0 ms, i.e. ~3.5 ms fixed), so scaling
        one point with the microbenchmark's overhead misprices small microbatches by ~2x.
        """
        f, i, w = self._unscaled_times(device, scale, ep)
        return f * self.time_scale, i * self.time_scale, w * self.time_scale

    def _unscaled_times(self, device, scale: float, ep: int) -> tuple[float, float, float]:
        m = self._measurement(device)
        if m is None:
            return self.f.time(device, scale, ep), self.i.time(device, scale, ep), self.w.time(device, scale, ep)
        first, second, ratio = m
        out = []
        for j, prog in enumerate((self.f, self.i, self.w)):
            r = 1.0
            if self.measured_as is not None:  # another variant of the timed programs: their roofline ratio
                base = self.measured_as[j].time(device, 1.0, ep)
                r = prog.time(device, 1.0, ep) / base if base > 0 else 1.0
            t0 = first[j] * r
            if second is not None and ratio != 1.0:
                # the line through both sizes: fixed cost + per-sample cost (clamped to >= 0)
                slope = max((second[j] * r - t0) / (ratio - 1.0), 0.0)
                const = min(max(t0 - slope, 0.0), t0)
                slope = t0 - const
            else:
                const = min(device.op_overhead_s * len(prog.flops), t0)
                slope = t0 - const
            out.append(const + scale * slope)
        return tuple(out)

    def _measurement(self, device):
        if self.measure is None or getattr(device, "name", None) != "cpu" or not getattr(device, "measured", False):
            return None
        hit = self.__dict__.get("_measured")
        if hit is None:
            hit = self.measure()
            object.__setattr__(self, "_measured", hit)
        return hit


@dataclass(frozen=True)
class Unit:
    name: str            # layer name in the real model, e.g. "layers.57"
    kind: UnitKind
    cut: int | None      # compute-node index where the unit starts in the captured graph (None if not captured)
    # the unit's parameters under the real model's FQNs (canonical names; for the ZeRO layout)
    params: tuple = field(default=(), compare=False, repr=False)
    experts: frozenset = field(default=frozenset(), compare=False, repr=False)  # of those, the expert weights
    muon: frozenset = field(default=frozenset(), compare=False, repr=False)  # of those, what autopar.Muon steps
