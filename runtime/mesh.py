"""The device mesh: which rank does what, and every process group autopar uses (built here only).

world = pp * dp * cp * tp. Global rank = (replica * pp + pp_rank) * tp + tp_rank, where
replica = dp_rank * cp + cp_rank numbers the dp*cp copies of one pipeline: tp is the innermost
axis (the tp ranks of one stage are contiguous, one node), then the pipeline.

Groups (all ranks create all of them, in the same order, as torch requires):
  pp_group       the pp ranks of one replica (stage-to-stage P2P, loss broadcast)
  replica_group  the dp*cp ranks holding the same pipeline rank: gradients of replicated
                 parameters are summed here (dp replicas see other samples, cp ranks other
                 sequence positions; the loss tangent already carries 1/(dp*m*cp))
  cp_group       the cp ranks of one dp replica (Ulysses all-to-alls)
  ep_group       ep consecutive replicas of one pipeline rank (expert all-to-alls); ep divides dp*cp;
                 folded (tp > 1 and ep > 1): ep consecutive (replica, tp rank) slots, ep divides dp*cp*tp
  expert_group   the replicas with the same ep_rank: gradients of expert-sharded parameters are
                 summed here
  tied_groups    per tied parameter, the pipeline ranks of one replica that hold it
  p2p_groups     per ordered pair of pipeline ranks that exchange activations or gradients,
                 a two-rank group carrying that direction's messages only (add_p2p_groups)
  tp_group       the tp ranks of one pipeline rank of one replica (tensor-parallel all-reduces)
Every group but tp_group joins ranks of the same tp rank. A group of one rank is None (nothing
to communicate).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

from autopar.collectives import comms
from autopar.plan import expert_slots


@dataclass
class Mesh:
    pp: int
    dp: int
    rank: int
    cp: int = 1
    ep: int = 1
    tp: int = 1
    pp_group: object = None
    replica_group: object = None
    cp_group: object = None
    ep_group: object = None
    expert_group: object = None
    tp_group: object = None
    tied_groups: dict = field(default_factory=dict)  # canonical fqn -> group of the pp ranks holding it
    p2p_groups: dict = field(default_factory=dict)   # (sending pp rank, receiving pp rank) -> group

    @property
    def world(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def pp_rank(self) -> int:
        return self.rank // self.tp % self.pp

    @property
    def replica(self) -> int:
        """Index of this rank's pipeline copy among the dp*cp of them."""
        return self.rank // (self.tp * self.pp)

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
    def folded(self) -> bool:
        """Experts folded over the tensor-parallel ranks (tp > 1 and ep > 1): a stage's experts are
        sharded over its dp*cp*tp ranks, the tp ranks of a replica being expert ranks of their own
        (each routes its share of the replica's tokens) instead of replicas of one another."""
        return expert_slots(self.dp, self.cp, self.tp, self.ep) > self.replicas

    @property
    def expert_slot(self) -> int:
        """This rank's index among the ranks of its stage the experts are laid over: the replica,
        or, folded, replica * tp + tp rank."""
        return self.replica * self.tp + self.tp_rank if self.folded else self.replica

    @property
    def ep_rank(self) -> int:
        return self.expert_slot % self.ep

    @property
    def expert_replicas(self) -> int:
        """Ranks holding the same experts (the expert-data-parallel group's size)."""
        return self.replicas * (self.tp if self.folded else 1) // self.ep

    @property
    def expert_replica(self) -> int:
        """This rank's index in its expert-data-parallel group."""
        return self.expert_slot // self.ep

    def global_rank(self, pp_rank: int) -> int:
        """Global rank of pipeline rank `pp_rank` in this process's replica and tp rank."""
        return (self.replica * self.pp + pp_rank) * self.tp + self.tp_rank

    def describe(self) -> str:
        parts = [f"pp rank {self.pp_rank}", f"dp rank {self.dp_rank}"]
        if self.cp > 1:
            parts.append(f"cp rank {self.cp_rank}")
        if self.ep > 1:
            parts.append(f"ep rank {self.ep_rank}")
        if self.tp > 1:
            parts.append(f"tp rank {self.tp_rank}")
        return ", ".join(parts)


def check_degrees(pp: int, dp: int, cp: int, ep: int, world: int, tp: int = 1) -> None:
    """Raise ValueError (before any communication) when the degrees don't fit the world."""
    if pp * dp * cp * tp != world:
        raise ValueError(f"autopar: plan needs pp*dp*cp*tp = {pp}*{dp}*{cp}*{tp} = {pp * dp * cp * tp} ranks but the "
                         f"process group has {world}; launch {pp * dp * cp * tp} processes or change the plan")
    slots = expert_slots(dp, cp, tp, ep)
    if slots % ep:
        over = f"dp*cp*tp = {dp}*{cp}*{tp}" if tp > 1 else f"dp*cp = {dp}*{cp}"
        raise ValueError(f"autopar: ep={ep} must divide {over} = {slots} (experts are sharded over the ranks holding "
                         "the same pipeline stage, folded over the tp ranks when tp > 1); change ep, dp or tp")


def build_mesh(pp: int, dp: int, timeout: timedelta, cp: int = 1, ep: int = 1, tp: int = 1) -> Mesh:
    """Create the groups of every mesh axis (all ranks call this in the same order)."""
    rank, world = comms.world()
    check_degrees(pp, dp, cp, ep, world, tp)
    mesh = Mesh(pp=pp, dp=dp, cp=cp, ep=ep, tp=tp, rank=rank)
    reps = dp * cp

    def at(rep: int, r: int, t: int) -> int:
        return (rep * pp + r) * tp + t

    def group(ranks: list[int]):
        """Every rank creates every group; a group of one rank is None."""
        return comms.new_group(ranks, timeout) if len(ranks) > 1 else None

    me = mesh.tp_rank
    for t in range(tp):
        for rep in range(reps):
            g = group([at(rep, r, t) for r in range(pp)])
            if (rep, t) == (mesh.replica, me):
                mesh.pp_group = g
        for r in range(pp):
            g = group([at(rep, r, t) for rep in range(reps)])
            if (r, t) == (mesh.pp_rank, me):
                mesh.replica_group = g
        for r in range(pp):
            for d in range(dp):
                g = group([at(d * cp + c, r, t) for c in range(cp)])
                if (r, d, t) == (mesh.pp_rank, mesh.dp_rank, me):
                    mesh.cp_group = g
    for rep in range(reps):
        for r in range(pp):
            g = group([at(rep, r, t) for t in range(tp)])
            if (rep, r) == (mesh.replica, mesh.pp_rank):
                mesh.tp_group = g
    if ep == 1:  # no expert sharding: experts (if any) are replicated like everything else
        mesh.expert_group = mesh.replica_group
        return mesh
    # the experts of a stage are laid over its "slots": the replicas of each tp rank apart, or,
    # folded, every (replica, tp rank) as slot replica * tp + t; ep consecutive slots share a
    # stage's experts (the ep group), slots with the same ep rank hold the same ones
    lanes, slots = (1, reps * tp) if mesh.folded else (tp, reps)

    def slot_rank(lane: int, s: int, r: int) -> int:
        return at(s // tp, r, s % tp) if mesh.folded else at(s, r, lane)

    mine = 0 if mesh.folded else me
    for lane in range(lanes):
        for r in range(pp):
            for block in range(slots // ep):
                g = group([slot_rank(lane, block * ep + e, r) for e in range(ep)])
                if (r, block, lane) == (mesh.pp_rank, mesh.expert_replica, mine):
                    mesh.ep_group = g
            for e in range(ep):
                g = group([slot_rank(lane, block * ep + e, r) for block in range(slots // ep)])
                if (r, e, lane) == (mesh.pp_rank, mesh.ep_rank, mine):
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
            for t in range(mesh.tp):
                g = comms.new_group([(rep * pp + r) * mesh.tp + t for r in owners], timeout)
                if (rep, t) == (mesh.replica, mesh.tp_rank) and mesh.pp_rank in owners:
                    mesh.tied_groups[fqn] = g


def add_p2p_groups(mesh: Mesh, stage_to_rank, timeout: timedelta) -> None:
    """One two-rank group per direction of every pair of pipeline ranks that hold adjacent
    stages (per replica and tp rank): the channel of schedules/nccl.py's ``"direction"`` layout.
    Under NCCL each group is its own communicator and stream, so a rank's sends to a peer never
    wait behind its receives from that peer (one shared communicator lets 1f1b's crossing
    send/receive pairs wait on each other forever once messages are too big to buffer)."""
    pp = mesh.pp
    pairs = sorted({(a, b) for s in range(len(stage_to_rank) - 1)
                    for a, b in ((stage_to_rank[s], stage_to_rank[s + 1]), (stage_to_rank[s + 1], stage_to_rank[s]))
                    if a != b})
    for rep in range(mesh.replicas):
        for t in range(mesh.tp):
            for a, b in pairs:
                g = comms.new_group([(rep * pp + r) * mesh.tp + t for r in sorted((a, b))], timeout)
                if (rep, t) == (mesh.replica, mesh.tp_rank) and mesh.pp_rank in (a, b):
                    mesh.p2p_groups[a, b] = g

