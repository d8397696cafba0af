"""Pipeline parallelism: which pipeline rank holds which stage, parameter and buffer.

``PipelineParallel`` owns the schedule's placement of stages on pipeline ranks, the groups of
pipeline ranks that share a tied parameter (an embedding on the first stage and the LM head on
the last), the sum of those parameters' gradients over their holders, and the state mapping
across pipeline ranks: a parameter or buffer's whole value lives on the pipeline rank that
holds the first stage using it, and ``gather_state`` broadcasts it from there (a checkpoint
writes it from there: ``is_owner``).
"""
from __future__ import annotations

from datetime import timedelta

import torch

from autopar.collectives import comms
from autopar.runtime.mesh import Mesh, add_p2p_groups, add_tied_groups

from .base import Parallelism


class PipelineParallel(Parallelism):
    name = "pp"

    def __init__(self, *, schedule, stages, trainable: set[str], aliases: dict[str, list[str]],
                 mesh: Mesh | None = None, timeout: timedelta | None = None, device: torch.device | None = None):
        """``aliases``: canonical FQN -> every name of that parameter (tied weights).
        With a mesh, creates the tied-parameter groups (collective: every rank, same order)."""
        self.schedule, self.mesh, self.device = schedule, mesh, device
        self.rank = mesh.pp_rank if mesh is not None else None
        self.owner_of: dict[str, int] = {}
        for st in stages:
            for fqn in st.params + st.buffers:
                self.owner_of.setdefault(fqn, schedule.stage_to_rank[st.index])
        self.canonical = {n: names[0] for names in aliases.values() for n in names}
        if mesh is not None:
            add_tied_groups(mesh, stages, trainable, schedule.stage_to_rank, timeout)
            add_p2p_groups(mesh, schedule.stage_to_rank, timeout)

    @property
    def my_stages(self) -> list[int]:
        """This process's stages (every stage in local mode)."""
        s2r = self.schedule.stage_to_rank
        return [s for s in range(len(s2r)) if self.rank is None or s2r[s] == self.rank]

    def is_owner(self, fqn: str) -> bool:
        """Whether this pipeline rank holds the primary copy of ``fqn`` (the one a checkpoint
        writes): the rank of the first stage using it, pipeline rank 0 for a tensor no stage
        uses; every tensor in local mode."""
        return self.rank is None or self.owner_of.get(fqn, 0) == self.rank

    def sum_tied_gradients(self, grads, skip) -> None:
        """Sum each tied parameter's gradient (``grads.accumulator``) over the pipeline ranks
        holding it (``skip(fqn)``: another owner sums it, e.g. inside a ZeRO flat buffer)."""
        for fqn, group in self.mesh.tied_groups.items():
            if not skip(fqn):
                comms.all_reduce_sum(grads.accumulator(fqn), group=group)

    def held(self, stages) -> tuple[set[str], set[str]]:
        """(parameter FQNs, buffer FQNs) this process's stages use."""
        mine = set(self.my_stages)
        params = {f for st in stages if st.index in mine for f in st.params}
        buffers = {f for st in stages if st.index in mine for f in st.buffers}
        return params, buffers

    def gather_state(self, values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Every name's whole value from the pipeline rank that owns it (collective over the
        pipeline ranks of this replica); ``values`` holds this rank's (whole-shaped) tensors,
        tied names included. Returns new tensors."""
        out: dict[str, torch.Tensor] = {}
        done: dict[str, torch.Tensor] = {}
        for name, t in values.items():
            canon = self.canonical.get(name, name)
            if canon in done:
                out[name] = done[canon]
                continue
            owner = self.owner_of.get(canon)
            v = t.detach().clone() if not t.is_meta else torch.empty(t.shape, dtype=t.dtype, device=self.device)
            if owner is not None and self.mesh is not None and self.mesh.pp > 1:
                comms.broadcast(v, src=self.mesh.global_rank(owner), group=self.mesh.pp_group)
            out[name] = done[canon] = v
        return out
