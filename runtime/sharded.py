"""ZeRO-2 and ZeRO-3 storage over the replicas of a pipeline rank, flat-buffer style.

The layout (which parameters form which flat group, padding, what is streamed and what stays
resident) is ``autopar.passes.zero_layout``; this module holds the tensors and moves them.
Each group is one flat vector padded to a multiple of the count R of replicas it is sharded
over, of which this rank keeps one contiguous shard: the fp32 ``master`` the user's optimizer
steps (optimizer states are 1/R). Dense groups are sharded over the dp*cp replicas of the
pipeline rank (``group``), expert-parallel groups over the expert-data-parallel group
(``expert_group``: the dp*cp/ep replicas holding the same experts); every mechanism below is
the same for both, each group communicating over its own process group.

Gradients: every W (or B) adds its parameter gradients into the group's flat fp32 gradient
buffer; when the last W of the step of every stage using the group has run, that buffer is
reduce-scattered (sum) asynchronously, so each replica ends with the summed gradient of its
shard, and the buffer is dropped. Groups holding a parameter tied across pipeline ranks are
first summed over its holders, at the end of the step. The loss tangent carries 1/(dp*m*cp),
so the sum is the mean: nothing is divided here (once, in the tangent).

ZeRO-2: parameters stay whole on every replica; after the optimizer step the updated shards
are all-gathered back into them.

ZeRO-3: the whole parameters of *streamed* groups are freed. The programs were rewritten by
``autopar.passes.zero_stream`` to call ``fetch(group, next)`` before a group's first use (it
all-gathers the shards into one of two preallocated gather buffers, alternating, unless that
buffer still holds the group, then starts prefetching the program's next group into the
other buffer) and ``release(group)`` after its last use. The resident group (norms, biases)
is gathered once after each optimizer step and kept whole. Peak parameter memory is the
shards + the two buffers + the resident group, not the whole stage.

Every replica runs the same programs in the same order, so the collectives (gathers in
program order, reduce-scatters when a stage finishes) are issued identically on every
replica of the group, and on every member of each process group in the same order.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn

from autopar.collectives import comms
from autopar.passes.zero_layout import ZeroLayout, shard_matrices, whole_matrices

from .optim import WrappedOptimizer


@dataclass
class FlatGroup:
    """One layout group's tensors on this rank (the layout's GroupSpec plus live state)."""

    name: str
    fqns: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    offsets: tuple[int, ...]
    numel: int
    padded: int
    dtype: torch.dtype
    streamed: bool                 # ZeRO-3: whole values live only in a gather buffer while in use
    tied: str | None               # fqn of the tied parameter this group holds (alone), or None
    stages: frozenset[int]         # this rank's stages that compute its gradients
    options: int = 0               # the parameter-group option set of its parameters
    expert: bool = False           # expert-parallel shards (sharded over the expert-data-parallel group)
    replicas: int = 1              # ranks it is sharded over
    replica: int = 0               # this rank's index among them (its shard)
    comm: object = None            # their process group (None: one rank)
    master: nn.Parameter = None    # this replica's fp32 shard
    grad_full: torch.Tensor | None = None
    pending: set[int] = field(default_factory=set)

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [flat[o: o + _numel(s)].view(s) for o, s in zip(self.offsets, self.shapes)]


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


class ShardedParameters:
    """The flat sharded storage of one rank's trained parameters (ZeRO-2 or ZeRO-3), laid out
    by ``layout``; also the fetch/release hooks the ZeRO-3 programs call."""

    def __init__(self, params: dict[str, nn.Parameter], layout: ZeroLayout, stage_params: dict[int, list[str]],
                 group, replica: int, tied_groups: dict, timeout, values=None, dtype: torch.dtype | None = None,
                 device: torch.device | None = None, expert_group=None, expert_replica: int = 0):
        """``params``: FQN -> the Parameter the programs read (ZeRO-2 writes the stepped values
        into it; the caller keeps the dict current); ``group``, ``replica``: the process group
        the dense groups are sharded over and this rank's index in it; ``expert_group``,
        ``expert_replica``: the same for the expert groups; ``values(fqns)``: whole values of a group's
        parameters, fetched one group at a time to build the fp32 master shards (default: the
        parameters themselves); ``dtype``: the compute dtype of the gather buffers and the
        resident group (default: the parameters'). The storage never changes a Parameter: the
        caller frees or replaces them (parallel/data.py)."""
        self.params, self.zero, self.layout = params, layout.zero, layout
        self.tied_groups, self.timeout = tied_groups, timeout
        users: dict[str, set[int]] = {}
        for s, names in stage_params.items():
            for fqn in names:
                users.setdefault(fqn, set()).add(s)
        self.device = device = device or torch.device("cpu")
        if values is None:
            def values(fqns):
                return {f: params[f].detach() for f in fqns}
        self.groups: list[FlatGroup] = []
        # ZeRO-3: each resident group's whole values (the caller points its parameters at them)
        self.residents: dict[str, torch.Tensor] = {}
        for spec in layout.groups:
            fqns = spec.fqns
            dtypes = {params[f].dtype for f in fqns}
            if len(dtypes) > 1:
                raise ValueError(f"autopar: ZeRO layer group {spec.name!r} mixes dtypes {sorted(map(str, dtypes))}; "
                                 "give the parameters of one layer one dtype")
            g = FlatGroup(spec.name, fqns, spec.shapes, spec.offsets, spec.numel, spec.padded, dtype or dtypes.pop(),
                          streamed=spec.streamed, tied=fqns[0] if spec.tied else None,
                          stages=frozenset(s for f in fqns for s in users[f]), options=spec.options,
                          expert=spec.expert, replicas=spec.replicas,
                          replica=expert_replica if spec.expert else replica,
                          comm=expert_group if spec.expert else group)
            shard = layout.shard(spec)
            with torch.no_grad():
                got = values(fqns)
                flat = self._flatten(g, [got[f].to(device) for f in fqns], torch.float32)
                g.master = nn.Parameter(flat[g.replica * shard: (g.replica + 1) * shard].clone())
                if self.zero == 3 and not g.streamed:
                    self.residents[g.name] = flat.to(g.dtype)
            del got, flat
            self.groups.append(g)
        self.group_of = {f: g for g in self.groups for f in g.fqns}
        # flat offset of every parameter in its group (read for every gradient of every W)
        self.offset_of = {f: o for g in self.groups for f, o in zip(g.fqns, g.offsets)}
        self.by_name = {g.name: g for g in self.groups}
        # ZeRO-3: two alternating gather buffers, sized for the largest streamed group
        streamed = [g for g in self.groups if g.streamed]
        size = max((g.padded for g in streamed), default=0)
        dtype = streamed[0].dtype if streamed else torch.float32
        self.buffers = [torch.empty(size, dtype=dtype, device=device) for _ in range(2 if streamed else 0)]
        self.holds: list[str | None] = [None, None]    # group whose current values a buffer holds
        self.in_use = [0, 0]
        self.inflight: list[object] = [None, None]     # pending all-gather into the buffer
        self.gathers = 0           # all-gathers issued (for tests and benchmarks)
        self.overflow_gathers = 0  # fetches that found both buffers in use (a temporary was allocated)
        self._reductions: list = []

    def resident_views(self) -> dict[str, torch.Tensor]:
        """ZeRO-3: FQN -> view of the resident buffer each resident parameter must be."""
        return {f: v for name, buf in self.residents.items() for f, v in zip(self.by_name[name].fqns,
                                                                             self.by_name[name].views(buf))}

    # -- layout ---------------------------------------------------------------------------------

    def _flatten(self, g: FlatGroup, tensors, dtype: torch.dtype | None = None) -> torch.Tensor:
        flat = torch.zeros(g.padded, dtype=dtype or g.dtype, device=self.device)
        for o, t in zip(g.offsets, tensors):
            flat[o: o + t.numel()].copy_(t.reshape(-1))
        return flat

    def _gather(self, g: FlatGroup, out: torch.Tensor, async_op: bool):
        self.gathers += 1
        src = g.master.detach().to(out.dtype)
        if g.comm is None:
            out[: g.padded].copy_(src)
            return None
        return comms.all_gather_flat(out[: g.padded], src, group=g.comm, async_op=async_op)

    def masters(self) -> list[nn.Parameter]:
        return [g.master for g in self.groups]

    # -- ZeRO-3 parameter streaming ---------------------------------------------------------------

    def fetch(self, name: str, next_name: str | None) -> list[torch.Tensor]:
        """Whole values of group `name`, in one of the gather buffers; prefetch `next_name`."""
        slot = self._slot_holding(name)
        if slot is None:
            slot = self._free_slot()
            if slot is None:  # both buffers in use by overlapping groups: a temporary, counted
                self.overflow_gathers += 1
                tmp = torch.empty(self.by_name[name].padded, dtype=self.by_name[name].dtype, device=self.device)
                w = self._gather(self.by_name[name], tmp, async_op=True)
                if w is not None:
                    w.wait(self.timeout)
                return self.by_name[name].views(tmp)
            self._start(name, slot)
        self._settle(slot)
        self.in_use[slot] += 1
        if next_name is not None and self._slot_holding(next_name) is None:
            other = 1 - slot
            if self.in_use[other] == 0:
                self._start(next_name, other)
        return self.by_name[name].views(self.buffers[slot])

    def release(self, name: str) -> None:
        slot = self._slot_holding(name)
        if slot is not None and self.in_use[slot] > 0:
            self.in_use[slot] -= 1

    def _slot_holding(self, name: str) -> int | None:
        for i, held in enumerate(self.holds):
            if held == name:
                return i
        return None

    def _free_slot(self) -> int | None:
        free = [i for i in (0, 1) if self.in_use[i] == 0]
        if not free:
            return None
        # alternate: prefer a buffer whose gather is not in flight (that one is a prefetch)
        idle = [i for i in free if self.inflight[i] is None]
        return (idle or free)[0]

    def _start(self, name: str, slot: int) -> None:
        self._settle(slot)
        self.holds[slot] = name
        self.inflight[slot] = self._gather(self.by_name[name], self.buffers[slot], async_op=True)

    def _settle(self, slot: int) -> None:
        if self.inflight[slot] is not None:
            self.inflight[slot].wait(self.timeout)
            self.inflight[slot] = None

    # -- gradients --------------------------------------------------------------------------------

    def begin_step(self) -> None:
        for g in self.groups:
            g.pending = set(g.stages)
            g.grad_full = None
            g.master.grad = None
        self._reductions = []

    def accumulate(self, fqn: str, grad: torch.Tensor) -> bool:
        """Add a parameter gradient into its group's flat buffer; False if not sharded here."""
        g = self.group_of.get(fqn)
        if g is None:
            return False
        if g.grad_full is None:
            g.grad_full = torch.zeros(g.padded, dtype=torch.float32, device=grad.device)
        o = self.offset_of[fqn]
        g.grad_full[o: o + grad.numel()].view(grad.shape).add_(grad)
        return True

    def stage_done(self, stage: int) -> None:
        """Every W/B of `stage` this step has run: reduce-scatter the groups that are now final."""
        for g in self.groups:
            if stage in g.pending:
                g.pending.discard(stage)
                if not g.pending and g.tied is None:
                    self._reduce_scatter(g)

    def _reduce_scatter(self, g: FlatGroup) -> None:
        full = g.grad_full
        if full is None:
            full = torch.zeros(g.padded, dtype=torch.float32, device=self.device)
        g.grad_full = None
        shard = torch.empty(g.padded // g.replicas, dtype=torch.float32, device=self.device)
        if g.comm is None:
            shard.copy_(full)
            work = None
        else:
            work = comms.reduce_scatter_sum(shard, full, group=g.comm, async_op=True)
        self._reductions.append((work, g, shard, full))

    def finish(self) -> None:
        """End of step: tied groups summed over their holders and reduce-scattered; wait for all
        (and for any gather still reading the shards, before the optimizer changes them)."""
        for i in range(len(self.buffers)):
            self._settle(i)
        for g in self.groups:
            if g.tied is not None:
                if g.grad_full is None:
                    g.grad_full = torch.zeros(g.padded, dtype=torch.float32, device=self.device)
                comms.all_reduce_sum(g.grad_full, group=self.tied_groups[g.tied])
                self._reduce_scatter(g)
        for work, g, shard, _full in self._reductions:
            if work is not None:
                work.wait(self.timeout)
            g.master.grad = shard
        self._reductions = []

    # -- after the optimizer step -----------------------------------------------------------------

    def after_step(self) -> None:
        """Bring the updated shards to where the programs read parameters."""
        for g in self.groups:
            g.master.grad = None
        if self.zero == 2:
            works = []
            for g in self.groups:
                full = torch.empty(g.padded, dtype=g.dtype, device=self.device)
                works.append((self._gather(g, full, async_op=True), g, full))
            with torch.no_grad():
                for w, g, full in works:
                    if w is not None:
                        w.wait(self.timeout)
                    for f, v in zip(g.fqns, g.views(full)):
                        self.params[f].copy_(v)
            return
        self.holds = [None, None]  # buffer contents are stale now
        works = [self._gather(self.by_name[name], buf, async_op=True) for name, buf in self.residents.items()]
        for w in works:
            if w is not None:
                w.wait(self.timeout)

    # -- whole values for state_dict / load_state_dict -------------------------------------------

    def whole(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """Every sharded parameter's whole value, in ``dtype`` (default the compute dtype; fp32:
        the masters themselves), collective over the replicas."""
        out = {}
        for g in self.groups:
            full = torch.empty(g.padded, dtype=dtype or g.dtype, device=self.device)
            w = self._gather(g, full, async_op=True)
            if w is not None:
                w.wait(self.timeout)
            out.update({f: v.clone() for f, v in zip(g.fqns, g.views(full))})
        return out

    def load(self, values: dict[str, torch.Tensor]) -> None:
        """Set the shards (and resident/whole copies) from whole values."""
        with torch.no_grad():
            for g in self.groups:
                flat = self._flatten(g, [values[f] for f in g.fqns], torch.float32)
                shard = g.padded // g.replicas
                g.master.copy_(flat[g.replica * shard: (g.replica + 1) * shard])
                if g.name in self.residents:
                    self.residents[g.name].copy_(flat)  # the resident parameters are views of it
                elif not g.streamed:
                    for f, v in zip(g.fqns, g.views(flat)):
                        self.params[f].data.copy_(v)
        self.holds = [None, None]  # the gather buffers hold values from before the load


class ShardedOptimizer(WrappedOptimizer):
    """The user's optimizer over the shards, one parameter group per option set (plus
    ``others``: parameter groups not sharded here; ``casts``: their fp32 masters and compute
    copies under mixed precision), then the shards to where programs read."""

    def __init__(self, sharded: ShardedParameters, optimizer_factory, options: list[dict], others: list[dict],
                 casts: dict | None = None):
        self.sharded = sharded
        groups = [{"params": [g.master for g in sharded.groups if g.options == k], **opts}
                  for k, opts in enumerate(options)]
        for k, group in enumerate(groups):
            if whole_matrices(group):  # aligned groups: the matrices in this replica's shard of each
                group["muon_matrices"] = [
                    shard_matrices(g.shapes, g.offsets, g.replica * (g.padded // g.replicas), g.padded // g.replicas)
                    for g in sharded.groups if g.options == k]
        super().__init__(optimizer_factory([g for g in groups if g["params"]] + list(others)), casts)

    def _after_step(self) -> None:
        self.sharded.after_step()
