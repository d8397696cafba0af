"""ZeRO-2/3 memory layout as data: which parameters form which flat group, what each replica
keeps, what is streamed and what stays resident. One definition, read by the runtime's flat
storage (runtime/sharded.py) and by the planner's memory model (planner/memory_model.py).

The parameters one pipeline rank trains (in model order, tied parameters once) are cut into
*layer groups* (``layer_group``: a numbered block such as ``layers.3``, else the owning
module). Expert-parallel shards (``experts``) are sharded the same way over the
*expert-data-parallel* group instead (the ``expert_replicas = dp*cp/ep`` replicas holding the
same experts): they form groups of their own, ``<group>/experts``, never mixed with the dense
parameters of the layer (one group is reduce-scattered and gathered over one process group);
with ``expert_replicas == 1`` (ep == dp*cp) they are left out: each is whole on its one
holder and stepped whole. A parameter held by stages on
several pipeline ranks (a tied embedding/head) forms a group alone: its gradient is summed
over its holders before the group is reduce-scattered. Under ZeRO-3 the parameters with fewer
than 2 dims (norms, biases) form one *resident* group instead, gathered once after each
optimizer step and kept whole. A group holds the parameters of one option set of the user's
parameter groups only (``option_of``: weight decay on or off, say): the layer's others form a
group of their own, named ``<group>/<option set>``.

Each group is one flat vector of ``numel`` elements padded to ``padded``, a multiple of the
count R of replicas it is sharded over (``GroupSpec.replicas``: dp*cp, or dp*cp/ep for an
expert group); every one of them keeps one contiguous ``padded / R`` shard, its fp32 master
(what the user's optimizer steps). ZeRO-3 frees the whole values of *streamed* groups
(every group but the resident one) and gathers each into one of two alternating buffers
sized for the largest streamed group while a program uses it.

No torch here: the planner prices layouts of models it never materializes.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Collection, Sequence

RESIDENT = "resident"
ALIGNED = "matrices"  # ZeRO-2: the one group of an aligned option set
MASTER_BYTES = 4  # the shards the optimizer steps are fp32


@dataclass(frozen=True)
class ParamSpec:
    """One parameter as the layout sees it: canonical FQN and shape."""

    fqn: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def ndim(self) -> int:
        return len(self.shape)


@dataclass(frozen=True)
class GroupSpec:
    """One flat group: its parameters in order, their offsets in the flat vector, its padded size."""

    name: str
    fqns: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    offsets: tuple[int, ...]
    numel: int
    padded: int            # numel rounded up to a multiple of ``replicas``
    streamed: bool         # ZeRO-3: whole values live only in a gather buffer while in use
    tied: bool             # a parameter held on several pipeline ranks, alone in its group
    options: int = 0       # index of the parameter-group option set its parameters share
    expert: bool = False   # expert-parallel shards, sharded over the expert-data-parallel group
    replicas: int = 1      # ranks the group is sharded over (dp*cp; dp*cp/ep for an expert group)


@dataclass(frozen=True)
class ZeroLayout:
    zero: int
    replicas: int                 # dp*cp: what the dense groups are sharded over
    groups: tuple[GroupSpec, ...]
    expert_replicas: int = 1      # dp*cp/ep: what the expert groups are sharded over

    def shard(self, g: GroupSpec) -> int:
        """Elements of ``g`` each of its replicas keeps."""
        return g.padded // g.replicas

    @property
    def residents(self) -> tuple[GroupSpec, ...]:
        """ZeRO-3: the groups kept whole (norms and biases, one group per option set)."""
        return tuple(g for g in self.groups if self.zero == 3 and not g.streamed)

    @property
    def gather_numel(self) -> int:
        """Elements of one of the two ZeRO-3 gather buffers (the largest streamed group)."""
        return max((g.padded for g in self.groups if g.streamed), default=0)

    @property
    def numel(self) -> int:
        return sum(g.numel for g in self.groups)

    @property
    def padded(self) -> int:
        return sum(g.padded for g in self.groups)

    @property
    def shard_numel(self) -> int:
        return sum(self.shard(g) for g in self.groups)

    def parameter_bytes(self, itemsize: int) -> dict[str, int]:
        """Bytes one replica allocates for parameters under this layout (``itemsize``: bytes of
        the parameters' own dtype): the fp32 master shards; under ZeRO-2 the whole parameters
        beside them; under ZeRO-3 the two gather buffers and the whole resident group."""
        out = {"master shards": self.shard_numel * MASTER_BYTES}
        if self.zero == 2:
            out["whole parameters"] = self.numel * itemsize
        else:
            out["gather buffers"] = (2 if self.gather_numel else 0) * self.gather_numel * itemsize
            out["resident"] = sum(g.padded for g in self.residents) * itemsize
        return out

    def gradient_bytes(self) -> int:
        """fp32 gradient bytes at the backward's peak: every group's whole flat buffer (it lives
        until the group's last W of the step) plus the reduce-scattered shard."""
        return (self.padded + self.shard_numel) * 4


def ns_flops(shape: Sequence[int], steps: int = 5) -> int:
    """Newton-Schulz FLOPs of Muon on a parameter of ``shape`` (a matrix, or a stack of them
    over the leading dims): per iteration and matrix the Gram matrix (2 m^2 n), its square
    (2 m^3) and the product with the iterate (2 m^2 n), m the short side."""
    m, n = sorted(shape[-2:])
    return math.prod(shape[:-2]) * steps * (4 * m * m * n + 2 * m ** 3)


def aligned_offsets(shapes: Sequence[tuple[int, ...]], replicas: int) -> tuple[tuple[int, ...], int]:
    """Offsets that put every parameter of ``shapes`` wholly inside one of ``replicas`` equal
    shards, and the padded size (``replicas`` times the largest shard): parameters are dealt
    largest Newton-Schulz cost first to the replica with the least cost so far (then the fewest
    elements, then the lowest index), and keep their order within a replica. Muon needs every
    matrix whole on the replica that steps it; the padding is the price (shards of whole
    matrices are seldom equal)."""
    numel = [math.prod(s) for s in shapes]
    cost = [ns_flops(s) if len(s) >= 2 else n for s, n in zip(shapes, numel)]
    load, size, owner = [0] * replicas, [0] * replicas, [0] * len(shapes)
    for i in sorted(range(len(shapes)), key=lambda i: (-cost[i], i)):
        r = min(range(replicas), key=lambda r: (load[r], size[r], r))
        owner[i] = r
        load[r] += cost[i]
        size[r] += numel[i]
    shard = max(size) if shapes else 0
    offsets, used = [0] * len(shapes), [0] * replicas
    for i in range(len(shapes)):
        r = owner[i]
        offsets[i] = r * shard + used[r]
        used[r] += numel[i]
    return tuple(offsets), shard * replicas


def flat_offsets(shapes: Sequence[tuple[int, ...]], replicas: int,
                 aligned: bool = False) -> tuple[tuple[int, ...], int]:
    """Offsets of ``shapes`` in one flat vector sharded over ``replicas``, and its padded size:
    packed one after the other (padded to a multiple of ``replicas``), or ``aligned_offsets``."""
    if aligned:
        return aligned_offsets(shapes, replicas)
    sizes = [math.prod(s) for s in shapes]
    return tuple(itertools.accumulate(sizes[:-1], initial=0)), -(-sum(sizes) // replicas) * replicas


def layer_group(fqn: str) -> str:
    """``layers.3.attn.wq.weight`` -> ``layers.3``; ``tok_emb.weight`` -> ``tok_emb``."""
    parts = fqn.split(".")
    for i, p in enumerate(parts[:-1]):
        if p.isdigit():
            return ".".join(parts[: i + 1])
    return ".".join(parts[:-1]) or parts[0]


def zero_layout(params: Sequence[ParamSpec], zero: int, replicas: int, tied: Collection[str] = (),
                option_of: dict[str, int] | None = None, experts: Collection[str] = (),
                expert_replicas: int = 1, aligned: Collection[int] = ()) -> ZeroLayout:
    """The flat groups of ``params`` (one rank's trained parameters, model order; an expert
    shard with its local shape) for ZeRO level ``zero`` (2 or 3): dense parameters over
    ``replicas`` replicas (dp*cp), the FQNs in ``experts`` over ``expert_replicas`` (dp*cp/ep;
    left out when 1); ``tied``: FQNs held on several pipeline ranks (each alone in a group);
    ``option_of``: FQN -> option-set index (default 0); ``aligned``: option-set indices whose
    groups place every parameter wholly in one replica's shard (``aligned_offsets``)."""
    assert zero in (2, 3), zero
    assert replicas >= 1 and expert_replicas >= 1 and replicas % expert_replicas == 0, (replicas, expert_replicas)
    tied, option_of, experts = set(tied), option_of or {}, set(experts)
    assert not tied & experts, sorted(tied & experts)  # an expert shard lives on one pipeline rank
    by_name: dict[tuple[str, int, bool], list[ParamSpec]] = {}
    for p in params:
        expert = p.fqn in experts
        if expert and expert_replicas == 1:
            continue  # whole on its one holder: stepped whole
        if p.fqn in tied:
            name = p.fqn
        elif zero == 3 and p.ndim < 2:
            name = RESIDENT
        elif zero == 2 and option_of.get(p.fqn, 0) in aligned:
            name = ALIGNED  # ZeRO-2 gathers nothing per layer: one group, whole matrices dealt over all
        else:
            name = layer_group(p.fqn)
        by_name.setdefault((name, option_of.get(p.fqn, 0), expert), []).append(p)
    groups = []
    for (base, opt, expert), members in by_name.items():
        name = (f"{base}/experts" if expert else base) + ("" if opt == 0 else f"/{opt}")
        n = expert_replicas if expert else replicas
        offsets, padded = flat_offsets([p.shape for p in members], n, aligned=opt in aligned)
        groups.append(GroupSpec(
            name=name, fqns=tuple(p.fqn for p in members), shapes=tuple(p.shape for p in members),
            offsets=offsets, numel=sum(p.numel for p in members), padded=padded,
            streamed=zero == 3 and base != RESIDENT, tied=base in tied, options=opt, expert=expert, replicas=n))
    return ZeroLayout(zero=zero, replicas=replicas, groups=tuple(groups), expert_replicas=expert_replicas)


# Muon's matrices in flat shards (autopar/muon.py; runtime/zero.py and runtime/sharded.py read them)

def shard_matrices(shapes, offsets, lo: int, n: int) -> list[tuple[int, tuple[int, int]]]:
    """``muon_matrices`` of one flat shard: (offset in the shard, 2-D shape) of every matrix of
    the parameters (``shapes`` at ``offsets`` in the flat vector) that lie in its elements
    ``[lo, lo + n)``; an aligned layout (passes/zero_layout.aligned_offsets) puts each
    parameter wholly in one shard."""
    out = []
    for shape, o in zip(shapes, offsets):
        size = math.prod(shape)
        if lo <= o < lo + n and size:
            assert o + size <= lo + n, (shape, o, lo, n)  # the layout keeps matrices whole
            r, c = shape[-2:]
            out += [(o - lo + k * r * c, (r, c)) for k in range(size // (r * c))]
    return out


def whole_matrices(options: dict) -> bool:
    """Whether a parameter group with these options needs each matrix whole on one rank."""
    return bool(options.get("muon"))
