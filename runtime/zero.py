"""ZeRO-1: optimizer states sharded over the dp replicas of a pipeline rank.

The parameters this rank trains are viewed as one flat fp32 vector, padded to a multiple of
dp. Each replica owns one contiguous shard: it keeps an fp32 master copy of that shard and
the optimizer state for it only (1/dp of the memory). A step: gradients (already summed over
tied-weight holders, scaled by 1/(dp*m)) are flattened in the reduce dtype, reduce-scattered
(sum) so every replica gets the summed gradient of its shard, the user's optimizer steps the
shard, and the updated shards are all-gathered back into the parameters (cast into their
dtype: bf16 compute copies under mixed precision). Elementwise optimizers (SGD, Adam, AdamW)
give the same numbers as the unsharded step.
"""
from __future__ import annotations

import torch

from . import comms


class ZeroOneOptimizer:
    def __init__(self, names: list[str], params: dict[str, torch.nn.Parameter], grads, optimizer_factory, dp_group,
                 dp: int, dp_rank: int, others: list[torch.nn.Parameter] = (), initial: dict | None = None,
                 reduce_dtype: torch.dtype = torch.float32):
        """``names``: the FQNs sharded here, in flat order; ``grads.accumulator(fqn)``: their
        gradients (runtime/stage_work.ParamGrads); ``others``: parameters stepped whole, beside
        the shard (expert-parallel shards); ``initial``: fp32 whole values the master shard
        starts from (default: the parameters)."""
        self.names, self.params, self.grads = list(names), params, grads
        self.group, self.dp, self.dp_rank, self.reduce_dtype = dp_group, dp, dp_rank, reduce_dtype
        numel = sum(params[f].numel() for f in self.names)
        self.shard = -(-numel // dp)  # ceil
        self.total = self.shard * dp
        lo = dp_rank * self.shard
        with torch.no_grad():
            flat = self._flatten([(initial or {}).get(f, params[f]).detach() for f in self.names], torch.float32)
            self.master = torch.nn.Parameter(flat[lo: lo + self.shard].clone())
        self.optimizer = optimizer_factory([self.master, *others])

    def reload(self, values: dict | None = None) -> None:
        """Take the shard from ``values`` (whole fp32 tensors by FQN; default the parameters),
        after load_state_dict."""
        lo = self.dp_rank * self.shard
        with torch.no_grad():
            src = [(values or {}).get(f, self.params[f]).detach() for f in self.names]
            self.master.copy_(self._flatten(src, torch.float32)[lo: lo + self.shard])

    def _flatten(self, tensors, dtype: torch.dtype) -> torch.Tensor:
        device = self.master.device if hasattr(self, "master") else (
            tensors[0].device if tensors else torch.device("cpu"))
        flat = torch.zeros(self.total, dtype=dtype, device=device)
        offset = 0
        for t in tensors:
            n = t.numel()
            flat[offset: offset + n].copy_(t.reshape(-1))
            offset += n
        return flat

    def whole(self) -> dict[str, torch.Tensor]:
        """Every sharded parameter's whole fp32 value, from the master shards (collective)."""
        full = torch.empty(self.total, dtype=torch.float32, device=self.master.device)
        comms.all_gather_flat(full, self.master.detach(), group=self.group)
        out, offset = {}, 0
        for f in self.names:
            n = self.params[f].numel()
            out[f] = full[offset: offset + n].view(self.params[f].shape).clone()
            offset += n
        return out

    def step(self) -> None:
        gflat = self._flatten([self.grads.accumulator(f) for f in self.names], self.reduce_dtype)
        gshard = torch.empty(self.shard, dtype=self.reduce_dtype, device=gflat.device)
        comms.reduce_scatter_sum(gshard, gflat, group=self.group)
        self.master.grad = gshard.to(torch.float32)
        self.optimizer.step()
        self.master.grad = None
        full = torch.empty(self.total, dtype=torch.float32, device=gflat.device)
        comms.all_gather_flat(full, self.master.detach(), group=self.group)
        offset = 0
        with torch.no_grad():
            for f in self.names:
                p = self.params[f]
                n = p.numel()
                p.copy_(full[offset: offset + n].view_as(p))
                offset += n

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.grads.zero()
        self.optimizer.zero_grad(set_to_none=set_to_none)
