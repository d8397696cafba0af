"""Tensor parallelism: the linears the captured graph proves shardable are split over ``tp``
ranks of one node (Megatron's column/row scheme, found by passes/tensor_parallel.py).

``TensorParallel`` owns the graph rewrite, which parameters are tp shards and their state
mapping: a sharded parameter's whole value is its ``tp`` blocks concatenated along the shard's
dim in tp rank order. Every other owner sees the tp shard as the parameter (the data-parallel
owner reduces, ZeRO-shards and steps it over the replicas of the same tp rank): ``whole`` of
those owners is this rank's block, which ``widen`` gathers over the tp group, and ``narrow``
cuts whole values to the blocks before the others load them. Replicated parameters get the same
gradient on every tp rank (the backward all-reduce of ``tp_copy`` makes every replicated
activation's gradient whole), so they need nothing here.
"""
from __future__ import annotations

import logging
from dataclasses import replace

import torch

from autopar.collectives import comms
from autopar.passes.costs import is_random
from autopar.passes.sequence_parallel import apply_sequence_parallel
from autopar.passes.tensor_parallel import apply_tensor_parallel, tp_plan_disagreements

from .base import Parallelism

log = logging.getLogger("autopar")


class TensorParallel(Parallelism):
    name = "tp"

    def __init__(self, *, tp: int, mesh, model, sequence_parallel: bool = False):
        self.tp, self.mesh, self.model, self.sequence_parallel = tp, mesh, model, sequence_parallel
        self.shards: dict = {}  # fqn -> passes.tensor_parallel.TpShard
        self.hints: list[str] = []  # where a Hugging Face tp_plan and the graph disagree

    def rewrite_capture(self, captured):
        res = apply_tensor_parallel(captured, self.tp, self.mesh.tp_rank, self.mesh.tp_group)
        self.shards, self.result = res.shards, res
        # a Hugging Face model's own plan, compared (never followed): pm.built.parallelisms["tp"].hints
        self.hints = tp_plan_disagreements(self.model, res.roles)
        for line in self.hints:
            log.info("autopar: tensor parallel: %s", line)
        self.sharded = frozenset(res.shards)
        if any(is_random(n) for n in res.captured.gm.graph.nodes):
            # dropout outside the sharded regions (the pass never shards one) must draw the same
            # mask on every tp rank: they hold the same activations there
            comms.share_rng_state(self.mesh.rank - self.mesh.tp_rank, self.mesh.tp_group)
            log.info("autopar: tensor parallel: the graph draws random numbers (dropout): the tp ranks share tp rank "
                     "0's random stream")
        named = dict(self.model.named_parameters())
        local = {}
        for f, sh in res.shards.items():
            p = named[f]
            local[f] = (torch.empty(sh.local_shape, dtype=p.dtype, device="meta") if p.is_meta
                        else sh.local(p.detach()).clone())
        from autopar.runtime.materialize import assign

        assign(self.model, local)
        log.info("autopar: tensor parallel over %d ranks: %d column and %d row linears sharded (%d parameters), "
                 "%d region(s) kept replicated", self.tp, len(res.columns), len(res.rows), len(res.shards),
                 len(res.replicated))
        if not self.sequence_parallel:
            return res.captured
        sp = apply_sequence_parallel(res.captured, self.tp, self.mesh.tp_group)
        self.sequence = sp
        log.info("autopar: sequence parallel: %d row sums reduce-scattered and %d column inputs all-gathered along the "
                 "tokens; %d value(s) gathered whole for replicated readers, %d sum(s) left all-reduces",
                 sp.scattered, sp.gathered, sp.gathers, sp.kept)
        return sp.captured

    def mark_gathered(self, options: dict) -> None:
        """Muon's sharded matrices (``options[fqn]["muon"]``): ``muon_tp`` = (the tp group, the
        shard), so its step all-gathers each matrix's update over tp, runs Newton-Schulz on the
        whole matrix (every tp rank the same) and keeps this rank's block (autopar/muon.py)."""
        name = self.mesh.tp_group.group_name
        for f, sh in self.shards.items():
            if options.get(f, {}).get("muon"):
                options[f] = {**options[f], "muon_tp": (name, replace(sh, fqn=""))}

    def local_of(self, fqn: str, whole: torch.Tensor) -> torch.Tensor:
        """This rank's block of a whole value (the value itself when ``fqn`` is not sharded)."""
        sh = self.shards.get(fqn)
        return whole if sh is None else sh.local(whole)

    def widen(self, values: dict) -> dict:
        """Whole values from this rank's blocks (collective over the tp group; every rank of it
        calls this with the same keys)."""
        out = dict(values)
        for f in sorted(self.shards):
            if f in out and not out[f].is_meta and tuple(out[f].shape) == self.shards[f].local_shape:
                sh = self.shards[f]
                block = out[f].detach().movedim(sh.dim, 0).contiguous()
                gathered = comms.all_gather_dim0(block, self.mesh.tp_group).movedim(0, sh.dim)
                out[f] = sh.whole(list(gathered.chunk(self.tp, sh.dim))).contiguous()
        return out

    def narrow(self, values: dict) -> dict:
        """This rank's blocks of whole values (the others unchanged)."""
        out = dict(values)
        for f, sh in self.shards.items():
            if f in out and tuple(out[f].shape) == sh.full_shape:
                out[f] = sh.local(out[f])
        return out

    def load_whole(self, values: dict) -> None:
        named = dict(self.model.named_parameters())
        with torch.no_grad():
            for f, sh in self.shards.items():
                p = named[f]
                if not p.is_meta and tuple(p.shape) == sh.local_shape:
                    p.copy_(values[f])  # state.load_whole_state narrowed them (narrow)
