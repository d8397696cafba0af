"""ZeRO-2 and ZeRO-3 over the replicas of a pipeline rank, flat-buffer style.

The parameters this rank trains are cut into *layer groups* (``layer_group``: a numbered
block such as ``layers.3``, else the owning module; a parameter tied across pipeline ranks
alone). Each group is one flat fp32 vector, padded to a multiple of the replica count R
(dp*cp), of which this rank keeps one contiguous shard: the ``master`` the user's optimizer
steps (optimizer states are 1/R).

Gradients: every W (or B) adds its parameter gradients into the group's flat fp32 gradient
buffer; when the last W of the step of every stage using the group has run, that buffer is
reduce-scattered (sum) asynchronously, so each replica ends with the summed gradient of its
shard, and the buffer is dropped. Groups holding a parameter tied across pipeline ranks are
first summed over its holders, at the end of the step. The loss tangent carries 1/(dp*m*cp),
so the sum is the mean: nothing is divided here (once, in the tangent).

ZeRO-2: parameters stay whole on every replica; after the optimizer step the updated shards
are all-gathered back into them.

ZeRO-3: the whole parameters of *streamed* groups are freed. ``stream_parameters`` rewrites
each F/I/W/B GraphModule so that a group's parameters are read from one of two preallocated
gather buffers, alternating: ``zero_fetch_<group>()`` before the group's first use (it
all-gathers the shards into the buffer unless that buffer still holds the group, then starts
prefetching the program's next group into the other buffer) and ``zero_release_<group>()``
after its last use (including uses through views). A value F saves for I (or I for W) that is
only a view of a streamed parameter (``t(weight)`` for a linear's input gradient) would alias
a buffer that is overwritten meanwhile: the consumer recomputes the view from the fetched
parameter instead. Small parameters (fewer than 2 dims: norms, biases) form one *resident*
group gathered once after each optimizer step and kept whole. Peak parameter memory is the
shards + the two buffers + the resident group, not the whole stage.

Every replica runs the same programs in the same order, so the collectives (gathers in
program order, reduce-scatters when a stage finishes) are issued identically on every
replica of the group.
"""
from __future__ import annotations

import operator
import re
from dataclasses import dataclass, field

import torch
import torch.fx as fx
import torch.nn as nn

from autopar.passes.split_backward import Program, StageProgram, param_key

from . import comms

RESIDENT = "resident"
_VIEW_OPS_WITHOUT_ALIAS_SCHEMA = {torch.ops.aten._unsafe_view.default}


def layer_group(fqn: str) -> str:
    """``layers.3.attn.wq.weight`` -> ``layers.3``; ``tok_emb.weight`` -> ``tok_emb``."""
    parts = fqn.split(".")
    for i, p in enumerate(parts[:-1]):
        if p.isdigit():
            return ".".join(parts[: i + 1])
    return ".".join(parts[:-1]) or parts[0]


@dataclass
class FlatGroup:
    name: str
    fqns: list[str]
    shapes: list[torch.Size]
    offsets: list[int]
    numel: int
    padded: int
    dtype: torch.dtype
    streamed: bool                 # ZeRO-3: whole values live only in a gather buffer while in use
    tied: str | None               # fqn of the tied parameter this group holds (alone), or None
    stages: frozenset[int]         # this rank's stages that compute its gradients
    master: nn.Parameter = None    # this replica's fp32 shard
    grad_full: torch.Tensor | None = None
    pending: set[int] = field(default_factory=set)

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [flat[o: o + s.numel()].view(s) for o, s in zip(self.offsets, self.shapes)]


class ShardedParameters:
    """The flat sharded storage of one rank's trained parameters (ZeRO-2 or ZeRO-3)."""

    def __init__(self, params: dict[str, nn.Parameter], stage_params: dict[int, list[str]], zero: int,
                 group, replicas: int, replica: int, tied_groups: dict, timeout):
        assert zero in (2, 3), zero
        self.params, self.zero, self.group = params, zero, group
        self.replicas, self.replica, self.tied_groups, self.timeout = replicas, replica, tied_groups, timeout
        users: dict[str, set[int]] = {}
        for s, names in stage_params.items():
            for fqn in names:
                users.setdefault(fqn, set()).add(s)
        by_name: dict[str, list[str]] = {}
        for fqn in [f for f in params if f in users]:  # model order
            p = params[fqn]
            if fqn in tied_groups:
                name = fqn
            elif zero == 3 and p.dim() < 2:
                name = RESIDENT
            else:
                name = layer_group(fqn)
            by_name.setdefault(name, []).append(fqn)
        self.groups: list[FlatGroup] = []
        for name, fqns in by_name.items():
            dtypes = {params[f].dtype for f in fqns}
            if len(dtypes) > 1:
                raise ValueError(f"autopar: ZeRO layer group {name!r} mixes dtypes {sorted(map(str, dtypes))}; "
                                 "give the parameters of one layer one dtype")
            shapes = [params[f].shape for f in fqns]
            offsets, total = [], 0
            for s in shapes:
                offsets.append(total)
                total += s.numel()
            padded = -(-total // replicas) * replicas
            g = FlatGroup(name, fqns, shapes, offsets, total, padded, dtypes.pop(),
                          streamed=zero == 3 and name != RESIDENT, tied=fqns[0] if name in tied_groups else None,
                          stages=frozenset(s for f in fqns for s in users[f]))
            shard = padded // replicas
            with torch.no_grad():
                flat = self._flatten(g, [params[f].detach() for f in fqns])
                g.master = nn.Parameter(flat[replica * shard: (replica + 1) * shard].to(torch.float32).clone())
            self.groups.append(g)
        self.group_of = {f: g for g in self.groups for f in g.fqns}
        # flat offset of every parameter in its group (read for every gradient of every W)
        self.offset_of = {f: o for g in self.groups for f, o in zip(g.fqns, g.offsets)}
        self.by_name = {g.name: g for g in self.groups}
        device = next(iter(params.values())).device if params else torch.device("cpu")
        self.device = device
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
        self.resident: torch.Tensor | None = None
        if zero == 3:
            for g in streamed:
                for f in g.fqns:
                    params[f].data = torch.empty(0, dtype=g.dtype, device=device)
            res = self.by_name.get(RESIDENT)
            if res is not None:
                self.resident = torch.empty(res.padded, dtype=res.dtype, device=device)
                for f, v in zip(res.fqns, res.views(self.resident)):
                    v.copy_(params[f].detach())
                    params[f].data = v

    # -- layout ---------------------------------------------------------------------------------

    def _flatten(self, g: FlatGroup, tensors) -> torch.Tensor:
        flat = torch.zeros(g.padded, dtype=g.dtype, device=tensors[0].device if tensors else self.params[g.fqns[0]].device)
        for o, t in zip(g.offsets, tensors):
            flat[o: o + t.numel()].copy_(t.reshape(-1))
        return flat

    def _gather(self, g: FlatGroup, out: torch.Tensor, async_op: bool):
        self.gathers += 1
        src = g.master.detach().to(g.dtype)
        if self.group is None:
            out[: g.padded].copy_(src)
            return None
        return comms.all_gather_flat(out[: g.padded], src, group=self.group, async_op=async_op)

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
        full = g.grad_full if g.grad_full is not None else torch.zeros(g.padded, dtype=torch.float32, device=self.device)
        g.grad_full = None
        shard = torch.empty(g.padded // self.replicas, dtype=torch.float32, device=self.device)
        if self.group is None:
            shard.copy_(full)
            work = None
        else:
            work = comms.reduce_scatter_sum(shard, full, group=self.group, async_op=True)
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
        res = self.by_name.get(RESIDENT)
        if res is not None:
            w = self._gather(res, self.resident, async_op=True)
            if w is not None:
                w.wait(self.timeout)

    # -- whole values for state_dict / load_state_dict -------------------------------------------

    def whole(self) -> dict[str, torch.Tensor]:
        """Every sharded parameter's whole value (collective over the replicas)."""
        out = {}
        for g in self.groups:
            full = torch.empty(g.padded, dtype=g.dtype, device=self.device)
            w = self._gather(g, full, async_op=True)
            if w is not None:
                w.wait(self.timeout)
            out.update({f: v.clone() for f, v in zip(g.fqns, g.views(full))})
        return out

    def load(self, values: dict[str, torch.Tensor]) -> None:
        """Set the shards (and resident/whole copies) from whole values."""
        with torch.no_grad():
            for g in self.groups:
                flat = self._flatten(g, [values[f].to(g.dtype) for f in g.fqns])
                shard = g.padded // self.replicas
                g.master.copy_(flat[self.replica * shard: (self.replica + 1) * shard].to(torch.float32))
                if self.resident is not None and g.name == RESIDENT:
                    # the parameters may point elsewhere right now (state_dict/load_state_dict
                    # swap whole values in): write the buffer their views live in
                    self.resident.copy_(flat)
                elif not g.streamed:
                    for f, v in zip(g.fqns, g.views(flat)):
                        self.params[f].data.copy_(v)
        self.holds = [None, None]  # the gather buffers hold values from before the load


class ShardedOptimizer:
    """The user's optimizer over the shards (plus any parameters not sharded here)."""

    def __init__(self, sharded: ShardedParameters, optimizer_factory, others: list[nn.Parameter]):
        self.sharded = sharded
        self.optimizer = optimizer_factory(sharded.masters() + list(others))

    def step(self) -> None:
        self.optimizer.step()
        self.sharded.after_step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def reload(self) -> None:
        """Nothing to do: load_state_dict writes the shards through ShardedParameters.load."""

    def state_dict(self):
        return self.optimizer.state_dict()


# -- the ZeRO-3 program rewrite ---------------------------------------------------------------------


class _Fetch(nn.Module):
    def __init__(self, sharded: ShardedParameters, name: str, next_name: str | None):
        super().__init__()
        self.sharded, self.group, self.next = sharded, name, next_name

    def forward(self):
        return tuple(self.sharded.fetch(self.group, self.next))


class _Release(nn.Module):
    def __init__(self, sharded: ShardedParameters, name: str):
        super().__init__()
        self.sharded, self.group = sharded, name

    def forward(self):
        self.sharded.release(self.group)


def stream_parameters(prog: StageProgram, sharded: ShardedParameters) -> StageProgram:
    """Rewrite a stage's programs so streamed parameters come from the gather buffers (ZeRO-3)."""
    streamed = {param_key(f): sharded.group_of[f] for f in sharded.group_of if sharded.group_of[f].streamed}
    programs = {"f": prog.f, "i": prog.i, "w": prog.w, "b": prog.b}
    # 1. saved values that are views of streamed parameters: recompute the view in the consumer
    for producer, consumers in (("f", ("i", "w", "b")), ("i", ("w",))):
        chains = _param_view_results(programs[producer], streamed)
        for c in consumers:
            programs[c] = _rematerialize(programs[c], chains)
    needed = {k for c in ("i", "w", "b") for k in programs[c].args}
    for producer in ("f", "i"):
        programs[producer] = _drop_results(programs[producer], lambda k: k.startswith("saved:") and k not in needed)
    # 2. parameter placeholders -> fetch from the alternating buffers
    for key, p in programs.items():
        programs[key] = _stream(p, streamed, sharded, f"stage{prog.stage.index}_{key.upper()}")
    return StageProgram(stage=prog.stage, f=programs["f"], i=programs["i"], w=programs["w"], b=programs["b"],
                        diff_outputs=prog.diff_outputs, grad_inputs=prog.grad_inputs, grad_params=prog.grad_params,
                        input_strides=prog.input_strides, saved_bytes=prog.saved_bytes,
                        saved_bytes_after_i=prog.saved_bytes_after_i, recompute=prog.recompute, joint=prog.joint,
                        regions=prog.regions)


def _is_alias(n: fx.Node) -> bool:
    """Does n's result alias its first argument (a view op)?"""
    if n.op != "call_function" or not n.args or not isinstance(n.args[0], fx.Node):
        return False
    if n.target in _VIEW_OPS_WITHOUT_ALIAS_SCHEMA:
        return True
    schema = getattr(n.target, "_schema", None)
    if schema is None or len(schema.returns) != 1 or not schema.arguments:
        return False
    ret, arg = schema.returns[0].alias_info, schema.arguments[0].alias_info
    return ret is not None and arg is not None and not ret.is_write


def _placeholders(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "placeholder"]


def _param_view_results(p: Program, streamed: dict) -> dict[str, tuple[str, list[fx.Node]]]:
    """Result key -> (param key, the view nodes from the parameter to the result, in order)."""
    key_of = dict(zip(_placeholders(p.gm), p.args))
    out_node = next(n for n in p.gm.graph.nodes if n.op == "output")
    found = {}
    for key, node in zip(p.results, out_node.args[0]):
        chain = []
        while isinstance(node, fx.Node) and _is_alias(node):
            chain.append(node)
            node = node.args[0]
        if isinstance(node, fx.Node) and node.op == "placeholder" and key_of.get(node) in streamed:
            found[key] = (key_of[node], chain[::-1])
    return found


def _rematerialize(p: Program, chains: dict) -> Program:
    if not any(k in chains for k in p.args):
        return p
    graph = p.gm.graph
    args = list(p.args)
    for key in [k for k in p.args if k in chains]:
        node_of = dict(zip(args, _placeholders(p.gm)))
        ph = node_of[key]
        pkey, chain = chains[key]
        src = node_of.get(pkey)
        if src is None:
            with graph.inserting_after(_placeholders(p.gm)[-1]):
                src = graph.placeholder(_safe(pkey))
            src.meta = dict(chain[0].args[0].meta) if chain else dict(ph.meta)
            args.append(pkey)
        if ph.users:
            first_user = min(ph.users, key=_order(graph).__getitem__)
            value = src
            with graph.inserting_before(first_user):
                for v in chain:
                    value = graph.call_function(v.target, (value, *v.args[1:]), dict(v.kwargs))
                    value.meta = dict(v.meta)
            ph.replace_all_uses_with(value)
        graph.erase_node(ph)
        args.remove(key)
    return _rebuild(p, graph, tuple(args), p.results)


def _drop_results(p: Program, drop) -> Program:
    out = next(n for n in p.gm.graph.nodes if n.op == "output")
    keep = [(k, v) for k, v in zip(p.results, out.args[0]) if not drop(k)]
    if len(keep) == len(p.results):
        return p
    out.args = (tuple(v for _, v in keep),)
    p.gm.graph.eliminate_dead_code()
    return _rebuild(p, p.gm.graph, p.args, tuple(k for k, _ in keep))


def _stream(p: Program, streamed: dict, sharded: ShardedParameters, tag: str) -> Program:
    graph = p.gm.graph
    order = _order(graph)
    by_group: dict[str, list[tuple[fx.Node, str]]] = {}
    for ph, key in zip(_placeholders(p.gm), p.args):
        if key in streamed and ph.users:
            by_group.setdefault(streamed[key].name, []).append((ph, key))
    if not by_group:
        return p
    spans = {}
    for name, phs in by_group.items():
        closure = _alias_closure([ph for ph, _ in phs])
        users = [u for n in closure for u in n.users]
        spans[name] = (min(order[u] for u in users), max(order[u] for u in users))
    sequence = sorted(spans, key=lambda nm: spans[nm][0])
    nodes = list(graph.nodes)
    args = list(p.args)
    for i, name in enumerate(sequence):
        g = sharded.by_name[name]
        first, last = nodes[spans[name][0]], nodes[spans[name][1]]
        mod = _safe(f"zero_fetch_{name}")
        p.gm.add_submodule(mod, _Fetch(sharded, name, sequence[i + 1] if i + 1 < len(sequence) else None))
        with graph.inserting_before(first):
            fetched = graph.call_module(mod, ())
            for ph, key in by_group[name]:
                idx = g.fqns.index(key[len("param:"):])
                item = graph.call_function(operator.getitem, (fetched, idx))
                item.meta = dict(ph.meta)
                ph.replace_all_uses_with(item)
        rel = _safe(f"zero_release_{name}")
        p.gm.add_submodule(rel, _Release(sharded, name))
        if last.op == "output":
            with graph.inserting_before(last):
                graph.call_module(rel, ())
        else:
            with graph.inserting_after(last):
                graph.call_module(rel, ())
        for ph, key in by_group[name]:
            graph.erase_node(ph)
            args.remove(key)
    out = _rebuild(p, graph, tuple(args), p.results)
    for result, node in zip(out.results, next(n for n in out.gm.graph.nodes if n.op == "output").args[0]):
        if isinstance(node, fx.Node) and node.op == "call_function" and node.target is operator.getitem \
                and isinstance(node.args[0], fx.Node) and node.args[0].op == "call_module":
            raise AssertionError(f"{tag}: result {result} is a streamed parameter itself")
    return out


def _alias_closure(roots: list[fx.Node]) -> set[fx.Node]:
    seen, todo = set(roots), list(roots)
    while todo:
        n = todo.pop()
        for u in n.users:
            if u not in seen and _is_alias(u) and u.args[0] is n:
                seen.add(u)
                todo.append(u)
    return seen


def _order(graph: fx.Graph) -> dict[fx.Node, int]:
    return {n: i for i, n in enumerate(graph.nodes)}


def _safe(name: str) -> str:
    return re.sub(r"\W", "_", name)


def _rebuild(p: Program, graph: fx.Graph, args: tuple, results: tuple) -> Program:
    graph.lint()
    p.gm.recompile()
    return Program(p.gm, args, results, p.flops)
