"""ZeRO-1: optimizer states sharded over the dp*cp replicas of a pipeline rank (expert shards:
over their expert-data-parallel group).

The parameters this rank trains are viewed as flat fp32 vectors, one per option set of the
user's parameter groups (weight decay on or off, say), each padded to a multiple of the count
of replicas it is sharded over: the dp*cp replicas of the pipeline rank, or, for a set of
expert-parallel shards, the expert-data-parallel group (the dp*cp/ep replicas holding the same
experts; a set never mixes the two). Each replica owns one contiguous shard of each: it keeps
an fp32 master copy of that shard and the optimizer state for it only (1/R of the memory).
At the end of the pipeline (``reduce``, the data-parallel owner calls it): gradients
(already summed over tied-weight holders, scaled by 1/(dp*m)) are flattened in the reduce
dtype and reduce-scattered (sum) over each set's group, so every replica holds the summed
gradient of its shards as the masters' ``.grad`` (clipping may scale them then). A step: the
user's optimizer steps the shards, and the updated shards are all-gathered back into the
parameters (cast into their dtype: bf16 compute copies under mixed precision).
Elementwise optimizers (SGD, Adam, AdamW) give the same numbers as the unsharded step.
"""
from __future__ import annotations

import math

import torch

from autopar.collectives import comms
from autopar.passes.zero_layout import flat_offsets, shard_matrices, whole_matrices

from .optim import WrappedOptimizer


class _FlatSet:
    """One option set's parameters as a flat vector and this replica's shard of it, sharded over
    ``group`` (``dp`` ranks, this one ``dp_rank``; None: one rank). ``aligned``: every parameter
    wholly inside one replica's shard (Muon: passes/zero_layout.aligned_offsets), else packed
    one after the other."""

    def __init__(self, names: list[str], params: dict, group, dp: int, dp_rank: int, initial: dict, device,
                 aligned: bool = False):
        self.names, self.group, self.dp = names, group, dp
        self.shapes = [tuple(params[f].shape) for f in names]
        self.offsets, self.total = flat_offsets(self.shapes, dp, aligned)
        self.shard = self.total // dp
        self.lo = dp_rank * self.shard
        self.device = device
        with torch.no_grad():
            flat = self.flatten([initial.get(f, params[f]).detach() for f in names], torch.float32)
            self.master = torch.nn.Parameter(flat[self.lo: self.lo + self.shard].clone())

    def gather(self, full: torch.Tensor) -> None:
        """``full`` (``total`` elements) = every replica's master shard, in replica order."""
        if self.group is None:
            full.copy_(self.master.detach())
        else:
            comms.all_gather_flat(full, self.master.detach(), group=self.group)

    def flatten(self, tensors, dtype: torch.dtype) -> torch.Tensor:
        flat = torch.zeros(self.total, dtype=dtype, device=self.device)
        for o, t in zip(self.offsets, tensors):
            flat[o: o + t.numel()].copy_(t.reshape(-1))
        return flat

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each parameter's value in ``flat`` (``total`` elements)."""
        return [flat[o: o + math.prod(s)].view(s) for o, s in zip(self.offsets, self.shapes)]


class ZeroOneOptimizer(WrappedOptimizer):
    def __init__(self, sets: list[tuple], params: dict[str, torch.nn.Parameter], grads,
                 optimizer_factory, dp_group, dp: int, dp_rank: int, others: list[dict] = (),
                 initial: dict | None = None, reduce_dtype: torch.dtype = torch.float32, device=None,
                 casts: dict | None = None):
        """``sets``: (FQNs in flat order, the options of their parameter group) per option set,
        or (FQNs, options, (group, ranks, this rank's index)) for a set sharded over another
        group than ``dp_group`` (expert-parallel shards: the expert-data-parallel group);
        ``grads.accumulator(fqn)``: their gradients (runtime/stage_work.ParamGrads); ``others``:
        parameter groups stepped whole, beside the shards (expert-parallel shards whose
        expert-data-parallel group is one rank); ``initial``: fp32 whole values the master
        shards start from (default: the parameters); ``casts``: the fp32 masters of ``others``
        and their compute copies under mixed precision (runtime/optim.py)."""
        self.params, self.grads = params, grads
        self.reduce_dtype = reduce_dtype
        device = device or (next(iter(params.values())).device if params else torch.device("cpu"))
        self.sets = [_FlatSet(list(entry[0]), params, *(entry[2] if len(entry) > 2 else (dp_group, dp, dp_rank)),
                              initial or {}, device, aligned=whole_matrices(entry[1])) for entry in sets]
        groups = [{"params": [s.master], **entry[1]} for s, entry in zip(self.sets, sets)]
        for s, g in zip(self.sets, groups):
            if whole_matrices(g):
                g["muon_matrices"] = [shard_matrices(s.shapes, s.offsets, s.lo, s.shard)]
        super().__init__(optimizer_factory(groups + list(others)), casts)

    @property
    def masters(self) -> list[torch.nn.Parameter]:
        return [s.master for s in self.sets]

    def reload(self, values: dict | None = None) -> None:
        """Take the shards from ``values`` (whole fp32 tensors by FQN; default the parameters),
        after load_state_dict."""
        with torch.no_grad():
            for s in self.sets:
                src = [(values or {}).get(f, self.params[f]).detach() for f in s.names]
                s.master.copy_(s.flatten(src, torch.float32)[s.lo: s.lo + s.shard])

    def whole(self) -> dict[str, torch.Tensor]:
        """Every sharded parameter's whole fp32 value, from the master shards (collective)."""
        out = {}
        for s in self.sets:
            full = torch.empty(s.total, dtype=torch.float32, device=s.device)
            s.gather(full)
            out.update({f: v.clone() for f, v in zip(s.names, s.views(full))})
        return out

    def reduce(self) -> None:
        """The summed gradient of this replica's shards, as the masters' ``.grad``."""
        for s in self.sets:
            gflat = s.flatten([self.grads.accumulator(f) for f in s.names], self.reduce_dtype)
            gshard = torch.empty(s.shard, dtype=self.reduce_dtype, device=gflat.device)
            if s.group is None:
                gshard.copy_(gflat)
            else:
                comms.reduce_scatter_sum(gshard, gflat, group=s.group)
            s.master.grad = gshard.to(torch.float32)

    def _after_step(self) -> None:
        for s in self.sets:
            s.master.grad = None
            full = torch.empty(s.total, dtype=torch.float32, device=s.device)
            s.gather(full)
            for f, v in zip(s.names, s.views(full)):
                self.params[f].copy_(v)
