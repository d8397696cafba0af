"""The device mesh: which rank does what, and every process group autopar uses (built here only).

world = pp * dp * cp. Global rank = replica * pp + pp_rank, where replica = dp_rank * cp +
cp_rank numbers the dp*cp copies of one pipeline (the ranks of one pipeline are contiguous).

Groups (all ranks create all of them, in the same order, as torch requires):
  pp_group       the pp ranks of one replica (stage-to-stage P2P, loss broadcast)
  replica_group  the dp*cp ranks holding the same pipeline rank: gradients of replicated
                 parameters are summed here (dp replicas see other samples, cp ranks other
                 sequence positions; the loss tangent already carries 1/(dp*m*cp))
  cp_group       the cp ranks of one dp replica (Ulysses all-to-alls)
  ep_group       ep consecutive replicas of one pipeline rank (expert all-to-alls); ep divides dp*cp
  expert_group   the replicas with the same ep_rank: gradients of expert-sharded parameters are
                 summed here
  tied_groups    per tied parameter, the pipeline ranks of one replica that hold it
A group of one rank is None (nothing to communicate).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

from . import comms


@dataclass
class Mesh:
    pp: int
    dp: int
    rank: int
    cp: int = 1
    ep: int = 1
    pp_group: object = None
    replica_group: object = None
    cp_group: object = None
    ep_group: object = None
    expert_group: object = None
    tied_groups: dict = field(default_factory=dict)  # canonical fqn -> group of the pp ranks holding it

    @property
    def world(self) -> int:
        return self.pp * self.dp * self.cp

    @property
    def pp_rank(self) -> int:
        return self.rank % self.pp

    @property
    def replica(self) -> int:
        """Index of this rank's pipeline copy among the dp*cp of them."""
        return self.rank // self.pp

    @property
    def replicas(self) -> int:
        return self.dp * self.cp

    @property
    def dp_rank(self) -> int:
        return self.replica // self.cp

    @property
    def cp_rank(self) -> int:
        return self.replica % self.cp

    @property
    def ep_rank(self) -> int:
        return self.replica % self.ep

    def global_rank(self, pp_rank: int) -> int:
        """Global rank of pipeline rank `pp_rank` in this process's replica."""
        return self.replica * self.pp + pp_rank

    def describe(self) -> str:
        parts = [f"pp rank {self.pp_rank}", f"dp rank {self.dp_rank}"]
        if self.cp > 1:
            parts.append(f"cp rank {self.cp_rank}")
        if self.ep > 1:
            parts.append(f"ep rank {self.ep_rank}")
        return ", ".join(parts)


def check_degrees(pp: int, dp: int, cp: int, ep: int, world: int) -> None:
    """Raise ValueError (before any communication) when the degrees don't fit the world."""
    if pp * dp * cp != world:
        raise ValueError(f"autopar: plan needs pp*dp*cp = {pp}*{dp}*{cp} = {pp * dp * cp} ranks but the process "
                         f"group has {world}; launch {pp * dp * cp} processes or change the plan")
    if (dp * cp) % ep:
        raise ValueError(f"autopar: ep={ep} must divide dp*cp = {dp}*{cp} = {dp * cp} (experts are sharded over "
                         "ranks holding the same pipeline stage); change ep or dp")


def build_mesh(pp: int, dp: int, timeout: timedelta, cp: int = 1, ep: int = 1) -> Mesh:
    """Create the groups of every mesh axis (all ranks call this in the same order)."""
    rank, world = comms.world()
    check_degrees(pp, dp, cp, ep, world)
    mesh = Mesh(pp=pp, dp=dp, cp=cp, ep=ep, rank=rank)
    reps = dp * cp

    def group(ranks: list[int]):
        """Every rank creates every group; a group of one rank is None."""
        return comms.new_group(ranks, timeout) if len(ranks) > 1 else None

    for rep in range(reps):
        g = group([rep * pp + r for r in range(pp)])
        if rep == mesh.replica:
            mesh.pp_group = g
    for r in range(pp):
        g = group([rep * pp + r for rep in range(reps)])
        if r == mesh.pp_rank:
            mesh.replica_group = g
    for r in range(pp):
        for d in range(dp):
            g = group([(d * cp + c) * pp + r for c in range(cp)])
            if (r, d) == (mesh.pp_rank, mesh.dp_rank):
                mesh.cp_group = g
    if ep == 1:  # no expert sharding: experts (if any) are replicated like everything else
        mesh.expert_group = mesh.replica_group
        return mesh
    for r in range(pp):
        for block in range(reps // ep):
            g = group([(block * ep + e) * pp + r for e in range(ep)])
            if (r, block) == (mesh.pp_rank, mesh.replica // ep):
                mesh.ep_group = g
        for e in range(ep):
            g = group([(block * ep + e) * pp + r for block in range(reps // ep)])
            if (r, e) == (mesh.pp_rank, mesh.ep_rank):
                mesh.expert_group = g
    return mesh


def add_tied_groups(mesh: Mesh, stages, trainable: set[str], stage_to_rank, timeout: timedelta) -> None:
    """Per parameter used by stages on several pipeline ranks, a group of its holders (per replica)."""
    pp, reps = mesh.pp, mesh.replicas
    # Every rank must derive the same groups: use what every rank knows of every stage (the
    # trainable parameters it uses), not the gradients only a stage's own rank traced.
    holders: dict[str, set[int]] = {}
    for st in stages:
        for fqn in st.params:
            if fqn in trainable:
                holders.setdefault(fqn, set()).add(stage_to_rank[st.index])
    for fqn in sorted(holders):
        owners = sorted(holders[fqn])
        if len(owners) < 2:
            continue
        for rep in range(reps):
            g = comms.new_group([rep * pp + r for r in owners], timeout)
            if rep == mesh.replica and mesh.pp_rank in owners:
                mesh.tied_groups[fqn] = g
