"""Context parallelism (Ulysses): the sequence of every input is sharded over ``cp`` ranks.

``ContextParallel`` owns the check that every input and the target can be cut along dim 1
(the sequence), each rank's shard of a batch tensor, and the graph rewrite
(passes/context_parallel.py: an all-to-all from sequence shards to head shards around every
attention and back, positions offset to the rank's shard). Its gradients are summed over the
cp ranks by the data-parallel owner (the cp ranks are replicas of the pipeline rank), and each
rank's mean loss weighs 1/cp (``loss_weight``).
"""
from __future__ import annotations

import logging

import torch

from autopar.passes.context_parallel import apply_context_parallel

from .base import Parallelism

log = logging.getLogger("autopar")


class ContextParallel(Parallelism):
    name = "cp"

    def __init__(self, *, cp: int, mesh):
        self.cp, self.mesh = cp, mesh

    @property
    def loss_weight(self) -> float:
        """Each cp rank's local mean loss is 1/cp of the sequence's."""
        return 1.0 / self.cp

    def check_inputs(self, inputs: tuple, target) -> None:
        """ValueError (before any communication) unless every tensor's dim 1 divides by cp."""
        named = [(f"input {i}", x) for i, x in enumerate(inputs)] + ([("the target", target)] if target is not None
                                                                     else [])
        for what, t in named:
            if t.dim() < 2 or t.shape[1] % self.cp:
                raise ValueError(f"autopar: cp={self.cp} shards every input and the target along dim 1 (the "
                                 f"sequence), but {what} has shape {tuple(t.shape)}; use a sequence length "
                                 f"divisible by {self.cp} or cp=1")

    def local(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's share of a batch tensor along the sequence (dim 1)."""
        n = t.shape[1] // self.cp
        return t.narrow(1, self.mesh.cp_rank * n, n).contiguous()

    def rewrite_capture(self, captured):
        out = apply_context_parallel(captured, self.cp, self.mesh.cp_rank, self.mesh.cp_group)
        log.info("autopar: context parallel over %d ranks: attention rewritten to all-to-all (Ulysses)", self.cp)
        return out
