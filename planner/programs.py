"""One FX program as the cost model sees it: per node FLOPs, bytes moved, dtype and whether it
is a view (``Program``, turned into seconds by a device profile), and the memory of a program's
values (``storage_bytes``: distinct storages; ``live_set``: the peak and end of what the
generated code keeps alive). Used by the profile (planner/profile.py) on every unit's F, I and W."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.fx as fx

from autopar.passes.costs import is_view as _is_view
from autopar.passes.costs import view_base as _base

_ATTENTION = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
              "_scaled_dot_product_cudnn_attention", "scaled_dot_product_attention",
              "_scaled_dot_product_flash_attention_for_cpu")


def is_attention_fwd(node: fx.Node) -> bool:
    return isinstance(node.target, torch._ops.OpOverload) and node.target._opname in _ATTENTION


@dataclass(frozen=True)
class Program:
    """One program's nodes as the cost model sees them (per captured microbatch)."""

    flops: tuple[float, ...]
    bytes_moved: tuple[float, ...]
    dtypes: tuple[str, ...]
    views: tuple[bool, ...]
    # per node, the part of ``bytes_moved`` that is expert weights read (and, in W, their
    # gradients written): once per program whatever the microbatch, and an expert-parallel rank
    # holds 1/ep of them (it runs the same rows through its own experts); () where none
    expert_bytes: tuple[float, ...] = ()

    @property
    def total_flops(self) -> float:
        return float(sum(self.flops))

    def time(self, device, scale: float, ep: int = 1) -> float:
        """Seconds on ``device`` when the work is ``scale`` times the captured microbatch's, on
        a rank of an expert-parallel group of ``ep``.

        Every node costs ``op_overhead_s`` plus max(compute, memory traffic); both terms scale
        with the work, except the expert weights a node reads or writes (``expert_bytes``):
        those are moved once and are 1/ep of the captured ones. So a program is ``const +
        scale * slope`` plus its expert nodes (computed once per device).
        """
        const, slope, experts = self._linear(device)
        return const + scale * slope + sum(max(c * scale, m * scale + e / ep) for c, m, e in experts)

    def _linear(self, device) -> tuple[float, float, tuple]:
        cache = self.__dict__.setdefault("_by_device", {})
        key = (device.name, device.op_overhead_s, device.mem_bandwidth, device.mem_efficiency,
               device.flops_efficiency, tuple(sorted(device.peak_flops.items())))
        hit = cache.get(key)
        if hit is None:
            rates = {dt: device.flops_rate(dt) for dt in set(self.dtypes)}
            bw = device.mem_bandwidth * device.mem_efficiency
            fixed = self.expert_bytes or (0.0,) * len(self.flops)
            nodes = [(f / rates[dt], (b - e) / bw, e / bw) for f, b, dt, v, e in
                     zip(self.flops, self.bytes_moved, self.dtypes, self.views, fixed) if not v]
            slope = sum(max(c, m) for c, m, e in nodes if not e)
            hit = cache[key] = (device.op_overhead_s * len(self.flops), slope, tuple(n for n in nodes if n[2]))
        return hit


def _float_val(node: fx.Node):
    val = node.meta.get("val")
    vals = val if isinstance(val, (tuple, list)) else (val,)
    return next((v for v in vals if isinstance(v, torch.Tensor) and v.is_floating_point()), None)


def _list_args(n: fx.Node) -> set[int]:
    """The ids of the nodes ``n`` takes inside list arguments (a dispatch op's parameter list)."""
    return {id(a) for x in n.args if isinstance(x, (list, tuple)) for a in x if isinstance(a, fx.Node)}


def _dispatch_bytes_and_dtype(n: fx.Node, flops: float) -> tuple[float, str]:
    """A dropless MoE dispatch op's (``moe_dispatch.is_dispatch_node``) memory traffic and
    compute dtype. Its parameter list is an argument of several ops of the chain (for autograd
    and the private graph), but the experts' weights are read once per program, by the op that
    computes with them (the one carrying FLOPs: the forward's GEMMs, W's gradient GEMMs, whose
    outputs are the gradients); the other ops move rows and handles (scalar int64 results), so
    the dtype is the rows': the first floating value upstream."""
    lists = _list_args(n)
    moved = float(n.meta.get("autopar_bytes", 0))
    moved += sum(a.meta.get("autopar_bytes", 0) for a in n.all_input_nodes if id(a) not in lists or flops)
    seen, todo = set(), [n]
    while todo:
        m = todo.pop(0)
        val = _float_val(m)
        if val is not None:
            return moved, str(val.dtype).replace("torch.", "")
        for a in m.all_input_nodes:
            if a not in seen:
                seen.add(a)
                todo.append(a)
    return moved, "float32"


def program_of(gm: fx.GraphModule, experts: frozenset = frozenset(), expert_grads: frozenset = frozenset()) -> Program:
    """``gm`` as the cost model sees it; ``experts``: the names of its placeholders holding
    expert weights, ``expert_grads``: of the values it returns, the names of the expert weights'
    gradients (``Program.expert_bytes``)."""
    from autopar.passes.moe_dispatch import is_dispatch_node

    flops, moved, dtypes, views, fixed = [], [], [], [], []
    written: dict[str, float] = {}  # a gradient's bytes on the op producing it (items of a tuple op included)
    if expert_grads:
        for n in gm.graph.nodes:
            if n.name in expert_grads:
                base = _base(n)
                written[base.name] = written.get(base.name, 0.0) + float(n.meta.get("autopar_bytes", 0))

    def read(n: fx.Node, lists: set) -> float:
        return sum(float(a.meta.get("autopar_bytes", 0)) for a in n.all_input_nodes
                   if _base(a).name in experts and (id(a) not in lists or n.meta.get("autopar_flops", 0)))

    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        if is_dispatch_node(n):
            f = float(n.meta.get("autopar_flops", 0))
            b, dt = _dispatch_bytes_and_dtype(n, f)
            lists = _list_args(n)
            flops.append(f)
            moved.append(b)
            dtypes.append(dt)
            views.append(False)
            fixed.append(min(b, read(n, lists) + written.get(n.name, 0.0)) if experts or written else 0.0)
            continue
        out = n.meta.get("autopar_bytes", 0)
        ins = sum(a.meta.get("autopar_bytes", 0) for a in n.all_input_nodes)
        val = n.meta.get("val")
        if isinstance(val, (tuple, list)):
            val = next((v for v in val if isinstance(v, torch.Tensor)), None)
        dt = str(val.dtype).replace("torch.", "") if isinstance(val, torch.Tensor) else "float32"
        flops.append(float(n.meta.get("autopar_flops", 0)))
        moved.append(float(out + ins))
        dtypes.append(dt)
        views.append(_is_view(n))
        fixed.append(0.0 if views[-1] or not (experts or written)
                     else min(float(out + ins), read(n, set()) + written.get(n.name, 0.0)))
    return Program(tuple(flops), tuple(moved), tuple(dtypes), tuple(views),
                   tuple(fixed) if any(fixed) else ())


def storage_bytes(nodes: Sequence[fx.Node], param_like: set[str]) -> float:
    """Bytes of the distinct storages behind ``nodes``: views resolve to their base; views of
    parameters/buffers/constants cost nothing (the state is counted elsewhere)."""
    bases: dict[str, float] = {}
    for n in nodes:
        base = _base(n)
        if base.op == "placeholder" and base.name in param_like:
            continue
        if base.name not in bases:
            bases[base.name] = float(base.meta.get("autopar_bytes", 0))
    return sum(bases.values())


def live_set(gm: fx.GraphModule, results: Sequence[str] = (), skip: tuple[str, ...] = ()) -> tuple[float, float]:
    """(peak, end) of the bytes of live node outputs while running ``gm`` in order, as the
    generated code frees them: an output lives until the last use of it or of any view of it
    (a view keeps its base's storage). Inputs (placeholders) are not counted: they are held
    elsewhere. Returned values whose key in ``results`` starts with one of ``skip`` are left out
    (with their bases). ``end`` is what is still live when the graph returns."""
    nodes = list(gm.graph.nodes)
    out = next(n for n in nodes if n.op == "output")
    vals = out.args[0] if isinstance(out.args[0], (tuple, list)) else (out.args[0],)
    skipped = set()
    if skip:
        skipped = {_base(v) for v, k in zip(vals, results) if isinstance(v, fx.Node) and k.startswith(skip)}
    base = {n: _base(n) for n in nodes}
    last = {}
    for i, n in enumerate(nodes):
        for a in n.all_input_nodes:
            last[base[a]] = i
    live, peak, end = 0.0, 0.0, 0.0
    sizes = {}
    for i, n in enumerate(nodes):
        if n is out:
            end = live
        if n.op == "call_function" and not _is_view(n) and n not in skipped:
            sizes[n] = float(n.meta.get("autopar_bytes", 0))
            live += sizes[n]
            peak = max(peak, live)
        for a in n.all_input_nodes:
            b = base[a]
            if last.get(b) == i and b in sizes:
                live -= sizes.pop(b)
    return peak, end


def units_of(captured):
    """(cuts, labels, stages): the captured graph cut at every block boundary."""
    from autopar.passes.split_stages import block_key, crossing_profile, split_stages

    order = [n for n in captured.gm.graph.nodes if n.op in ("call_function", "get_attr")]
    _, allowed = crossing_profile(order)
    keys, prev = [], None
    for node in order:
        k = block_key(node)
        prev = prev if k is ... else k
        keys.append(prev)
    cuts = [c for c in range(1, len(order)) if allowed[c] and keys[c] != keys[c - 1]]
    # block keys come from the capture wrapper's module tree ("model.layers.3"): drop its prefix
    labels = [None if k is None else k.removeprefix("model.") for k in [keys[0]] + [keys[c] for c in cuts]]
    return cuts, labels, split_stages(captured, len(cuts) + 1, cuts)
