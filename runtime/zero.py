"""ZeRO-1: optimizer states sharded over the dp replicas of a pipeline rank.

The parameters this rank trains are viewed as one flat fp32 vector, padded to a multiple of
dp. Each replica owns one contiguous shard: it keeps an fp32 master copy of that shard and
the optimizer state for it only (1/dp of the memory). A step: gradients (already summed over
tied-weight holders, scaled by 1/(dp*m)) are flattened, reduce-scattered (sum) so every
replica gets the summed gradient of its shard, the user's optimizer steps the shard, and the
updated shards are all-gathered back into the parameters. Elementwise optimizers (SGD, Adam,
AdamW) give the same numbers as the unsharded step.
"""
from __future__ import annotations

import torch

from . import comms


class ZeroOneOptimizer:
    def __init__(self, params: list[torch.nn.Parameter], optimizer_factory, dp_group, dp: int, dp_rank: int,
                 others: list[torch.nn.Parameter] = ()):
        """``others``: parameters stepped whole, beside the shard (expert-parallel shards)."""
        self.params = params
        self.group, self.dp, self.dp_rank = dp_group, dp, dp_rank
        numel = sum(p.numel() for p in params)
        self.shard = -(-numel // dp)  # ceil
        self.total = self.shard * dp
        lo = dp_rank * self.shard
        with torch.no_grad():
            flat = self._flatten([p.detach() for p in params])
            self.master = torch.nn.Parameter(flat[lo: lo + self.shard].clone())
        self.optimizer = optimizer_factory([self.master, *others])

    def reload(self) -> None:
        """Take the shard from the parameters again (after load_state_dict)."""
        lo = self.dp_rank * self.shard
        with torch.no_grad():
            self.master.copy_(self._flatten([p.detach() for p in self.params])[lo: lo + self.shard])

    def _flatten(self, tensors) -> torch.Tensor:
        device = self.params[0].device if self.params else torch.device("cpu")
        flat = torch.zeros(self.total, dtype=torch.float32, device=device)
        offset = 0
        for t in tensors:
            n = t.numel()
            flat[offset: offset + n].copy_(t.reshape(-1))
            offset += n
        return flat

    def step(self) -> None:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        gflat = self._flatten(grads)
        gshard = torch.empty(self.shard, dtype=torch.float32, device=gflat.device)
        comms.reduce_scatter_sum(gshard, gflat, group=self.group)
        self.master.grad = gshard
        self.optimizer.step()
        self.master.grad = None
        full = torch.empty(self.total, dtype=torch.float32, device=gflat.device)
        comms.all_gather_flat(full, self.master.detach(), group=self.group)
        offset = 0
        with torch.no_grad():
            for p in self.params:
                n = p.numel()
                p.copy_(full[offset: offset + n].view_as(p))
                offset += n

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None
        self.optimizer.zero_grad(set_to_none=set_to_none)
