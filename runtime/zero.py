"""ZeRO-1: optimizer states sharded over the dp replicas of a pipeline rank.

The parameters this rank trains are viewed as flat fp32 vectors, one per option set of the
user's parameter groups (weight decay on or off, say), each padded to a multiple of dp. Each
replica owns one contiguous shard of each: it keeps an fp32 master copy of that shard and the
optimizer state for it only (1/dp of the memory). At the end of the pipeline (``reduce``, the
data-parallel owner calls it): gradients (already summed over tied-weight holders, scaled by
1/(dp*m)) are flattened in the reduce dtype and reduce-scattered (sum), so every replica holds
the summed gradient of its shards as the masters' ``.grad`` (clipping may scale them then). A
step: the user's optimizer steps the shards, and the updated shards are all-gathered back into
the parameters (cast into their dtype: bf16 compute copies under mixed precision).
Elementwise optimizers (SGD, Adam, AdamW) give the same numbers as the unsharded step.
"""
from __future__ import annotations

import torch

from . import comms
from .optim import WrappedOptimizer


class _FlatSet:
    """One option set's parameters as a flat vector and this replica's shard of it."""

    def __init__(self, names: list[str], params: dict, dp: int, dp_rank: int, initial: dict, device):
        self.names = names
        numel = sum(params[f].numel() for f in names)
        self.shard = -(-numel // dp)  # ceil
        self.total = self.shard * dp
        self.lo = dp_rank * self.shard
        self.device = device
        with torch.no_grad():
            flat = self.flatten([initial.get(f, params[f]).detach() for f in names], torch.float32)
            self.master = torch.nn.Parameter(flat[self.lo: self.lo + self.shard].clone())

    def flatten(self, tensors, dtype: torch.dtype) -> torch.Tensor:
        flat = torch.zeros(self.total, dtype=dtype, device=self.device)
        offset = 0
        for t in tensors:
            n = t.numel()
            flat[offset: offset + n].copy_(t.reshape(-1))
            offset += n
        return flat


class ZeroOneOptimizer(WrappedOptimizer):
    def __init__(self, sets: list[tuple[list[str], dict]], params: dict[str, torch.nn.Parameter], grads,
                 optimizer_factory, dp_group, dp: int, dp_rank: int, others: list[dict] = (),
                 initial: dict | None = None, reduce_dtype: torch.dtype = torch.float32, device=None):
        """``sets``: (FQNs in flat order, the options of their parameter group) per option set;
        ``grads.accumulator(fqn)``: their gradients (runtime/stage_work.ParamGrads); ``others``:
        parameter groups stepped whole, beside the shards (expert-parallel shards);
        ``initial``: fp32 whole values the master shards start from (default: the parameters)."""
        self.params, self.grads = params, grads
        self.group, self.dp, self.dp_rank, self.reduce_dtype = dp_group, dp, dp_rank, reduce_dtype
        device = device or (next(iter(params.values())).device if params else torch.device("cpu"))
        self.sets = [_FlatSet(list(names), params, dp, dp_rank, initial or {}, device) for names, _o in sets]
        groups = [{"params": [s.master], **opts} for s, (_n, opts) in zip(self.sets, sets)] + list(others)
        super().__init__(optimizer_factory(groups))

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
            comms.all_gather_flat(full, s.master.detach(), group=self.group)
            offset = 0
            for f in s.names:
                n = self.params[f].numel()
                out[f] = full[offset: offset + n].view(self.params[f].shape).clone()
                offset += n
        return out

    def reduce(self) -> None:
        """The summed gradient of this replica's shards, as the masters' ``.grad``."""
        for s in self.sets:
            gflat = s.flatten([self.grads.accumulator(f) for f in s.names], self.reduce_dtype)
            gshard = torch.empty(s.shard, dtype=self.reduce_dtype, device=gflat.device)
            comms.reduce_scatter_sum(gshard, gflat, group=self.group)
            s.master.grad = gshard.to(torch.float32)

    def _after_step(self) -> None:
        for s in self.sets:
            s.master.grad = None
            full = torch.empty(s.total, dtype=torch.float32, device=s.device)
            comms.all_gather_flat(full, s.master.detach(), group=self.group)
            offset = 0
            for f in s.names:
                p = self.params[f]
                n = p.numel()
                p.copy_(full[offset: offset + n].view_as(p))
                offset += n
