"""Predicted step time and per-rank memory of one candidate plan (degrees + schedule +
microbatching + stage boundaries + recompute), from a ModelProfile and a DeviceProfile.

``Evaluator`` prices a (``Layout``, ``Partition``) into an ``Estimate``; each term lives with
its concern:

* planner/layout.py: the plan as data (Layout, Partition, Estimate, Precision);
* planner/time_model.py (``TimeModel``): unit and stage F/I/W times, CP/EP/ZeRO-3
  communication, the schedule and its simulation inputs, the data-parallel reduction and the
  optimizer step after the pipeline;
* planner/memory_model.py (``MemoryModel``): parameters, gradients and optimizer states per
  ZeRO level, saved activations at the schedule's peak, working sets, P2P and reduction buffers;
* planner/offload_model.py (``OffloadModel``): the activation offload's shares, peaks and
  copy time;
* planner/inflight.py: what a fixed schedule holds in flight per rank, without walking it at
  every m.

This module composes them (``evaluate``: costs -> schedule -> simulation -> memory -> report)
and re-exports their names for callers.
"""
from __future__ import annotations

from autopar.schedules import simulate

from .inflight import (
    VALIDATE_MAX_ACTIONS,
    fixed_schedule,
    frontier_peaks,
    inflight_frontier,
    max_inflight,
    stage_inflight,
    steady_m,
)
from .layout import OPTIMIZERS, Estimate, GiB, Layout, Partition, Precision, divisors, normal_offload, offload_label
from .memory_model import DEFAULT_MOE_IMBALANCE, MemoryModel, runtime_overhead
from .offload_model import OffloadModel, least_offload, offload_peaks, offload_points, offload_terms, points_peaks
from .profile import ModelProfile
from .time_model import CPU_P2P_LATENCY_S, CPU_P2P_MESSAGE_S, CPU_SHARED_BANDWIDTH, GLOO_EFFICIENCY, TimeModel

__all__ = [
    "CPU_P2P_LATENCY_S", "CPU_P2P_MESSAGE_S", "CPU_SHARED_BANDWIDTH", "DEFAULT_MOE_IMBALANCE", "GLOO_EFFICIENCY",
    "GiB", "OPTIMIZERS", "VALIDATE_MAX_ACTIONS", "Estimate", "Evaluator", "Layout", "Partition", "Precision",
    "divisors", "fixed_schedule", "frontier_peaks", "inflight_frontier", "least_offload", "max_inflight",
    "normal_offload", "offload_label", "offload_peaks", "offload_points", "offload_terms", "points_peaks",
    "runtime_overhead", "stage_inflight", "steady_m",
]


class Evaluator(TimeModel, MemoryModel, OffloadModel):
    """Prices candidates of one model on one device; caches unit times per (kind, scale), the
    simulations of identical pipelines, activation peaks and ZeRO layouts."""

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
        self._remade: Evaluator | None = None
        self._tp: dict[int, Evaluator] = {}
        self._links: dict = {}  # (pp, dp, cp, ep, tp) -> each axis's link class (TimeModel.links)
        self.tp = 1  # the tensor-parallel degree its profile is seen at (for_tp)
        self.loss_chunking = loss_chunking
        self.offloading = offloading

    def for_tp(self, tp: int) -> "Evaluator":
        """The Evaluator of one rank of a tensor-parallel group of ``tp`` (``ModelProfile.at_tp``),
        on the same device, limit and batch (memoized; itself at tp=1)."""
        if tp == self.tp:
            return self
        assert self.tp == 1, "for_tp of an Evaluator that already prices one tp degree"
        hit = self._tp.get(tp)
        if hit is None:
            hit = self._tp[tp] = self._like(self.profile.at_tp(tp), tp)
        return hit

    def _like(self, profile, tp: int) -> "Evaluator":
        """An Evaluator of another form of this model (tp share, chunked loss, remade backward)
        with this one's device, limit, batch and settings, seen at ``tp``."""
        ev = Evaluator(profile, self.device, self.memory_limit, self.global_batch, self.bucket_bytes,
                       self.moe_imbalance, loss_chunking=self.loss_chunking, offloading=self.offloading,
                       optimizer=self.optimizer)
        ev.tp = tp
        return ev

    @property
    def chunked(self) -> "Evaluator | None":
        """The Evaluator of the same model with its loss chunked (``ModelProfile.chunked``), on
        the same device, limit and batch; None when the model has no chunkable loss (or
        ``loss_chunking`` is off)."""
        if self.profile.chunked is None or not self.loss_chunking:
            return None
        if self._chunked is None:
            self._chunked = self._like(self.profile.chunked, self.tp)
        return self._chunked

    @property
    def remade(self) -> "Evaluator | None":
        """The Evaluator of the same model with every stage's backward making element-wise values
        again (``ModelProfile.remade``, ``Plan.remake``), with the same settings; None where the
        profile has no such variant (a compiled one is in that form already)."""
        if self._remade is None and self.profile.remade is not None:
            self._remade = self._like(self.profile.remade, self.tp)
        return self._remade

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
        # a fixed order is a function of (schedule, pp, m, v); zb-auto's is searched per call
        # (never cached: an id() could be reused by the next schedule once this one is freed)
        key = None if lay.schedule == "zb-auto" else (lay.schedule, lay.pp, lay.m, lay.v, costs, msg, links["pp"],
                                                     sb, frac)
        sim = self._sims.get(key) if key is not None else None
        if sim is None:
            sim = simulate(sched, costs, p2p_latency=alpha, p2p_bandwidth=links["pp"].bandwidth,
                           message_bytes=msg, stage_bytes=sb, i_free_fraction=frac, memory=False,
                           timeline=False)
            if key is not None:
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
