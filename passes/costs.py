"""Per-node cost annotation: FLOPs and output bytes from fake tensors (no real compute).

Every call_function node of an annotated graph gets
  node.meta["autopar_flops"]  -- floating point operations of the op (torch's FlopCounterMode rules)
  node.meta["autopar_bytes"]  -- bytes of the tensors the op returns
Placeholders get bytes only. Views report their output size too; `value_bytes` is what an
activation costs to keep or send, which is what the stage splitter and the memory model want.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from autopar import linear_ce

from . import moe_dispatch

# A crude CPU-ish roofline used only to *balance* stages against each other; the planner
# (autopar.planner) owns the calibrated per-device model. Units: seconds.
_BALANCE_FLOPS_PER_S = 1e11
_BALANCE_BYTES_PER_S = 1e10


def _causal(flops: int, is_causal: bool) -> int:
    # a causal flash kernel skips the masked half of the score blocks
    return flops // 2 if is_causal else flops


def _cpu_flash_fwd(query, key, value, dropout_p=0.0, is_causal=False, *args, out_val=None, **kwargs) -> int:
    return _causal(sdpa_flop_count(query, key, value), is_causal)


def _cpu_flash_bwd(grad_out, query, key, value, out, logsumexp, dropout_p=0.0, is_causal=False, *args,
                   out_val=None, **kwargs) -> int:
    return _causal(sdpa_backward_flop_count(grad_out, query, key, value), is_causal)


# torch's FlopCounterMode has no rule for the CPU flash-attention kernels (what SDPA becomes when
# a graph is traced on CPU / fake-CPU tensors); without these, attention would count as free.
_EXTRA_FLOP_RULES = {
    # keyed by overload packet; FlopCounterMode passes shapes in place of tensors
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_flash_fwd,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_flash_bwd,
    # the chunked cross-entropy (autopar/linear_ce.py): its head GEMMs
    **{op.overloadpacket: (lambda *shapes, out_val=None, _op=op, **kw: linear_ce.flops(_op, shapes))
       for op in (linear_ce.FORWARD_OP, linear_ce.GRAD_WEIGHT_OP, linear_ce.GRAD_WEIGHT_INTO_OP)},
}


# ops whose output aliases their first input's storage besides those torch marks ``is_view``
_VIEW_LIKE = {"_unsafe_view", "alias", "detach", "lift_fresh", "lift_fresh_copy"}


def is_view(node: fx.Node) -> bool:
    """The node's value shares the storage of its first input (a view op, or one item of a
    tuple-valued op)."""
    t = node.target
    if t is operator.getitem:
        return True
    if isinstance(t, torch._ops.OpOverload):
        return bool(t.is_view) or t._opname in _VIEW_LIKE
    return False


def view_base(node: fx.Node, items: bool = True) -> fx.Node:
    """The node whose storage ``node``'s value holds: its chain of views walked back (the one
    view-base walk of the passes and the planner). ``items=False`` stops at an item of a
    tuple-valued op, counting each item as a storage of its own (the backward's remaking)."""
    while node.op == "call_function" and is_view(node) and node.all_input_nodes and (
            items or node.target is not operator.getitem):
        node = node.all_input_nodes[0]
    return node


def value_bytes(val) -> int:
    """Bytes held by a (possibly nested) node value: the sum over its tensors."""
    total = 0
    for leaf in tree_leaves(val):
        if isinstance(leaf, torch.Tensor):
            total += leaf.numel() * leaf.element_size()
    return total


def node_time(node: fx.Node) -> float:
    """Relative cost of one node for stage balancing: max(compute, memory traffic)."""
    if node.op != "call_function" or node.target is operator.getitem:
        return 0.0  # a getitem's bytes are already counted by the op that produced the tuple
    flops = node.meta.get("autopar_flops", 0)
    nbytes = node.meta.get("autopar_bytes", 0)
    return max(flops / _BALANCE_FLOPS_PER_S, nbytes / _BALANCE_BYTES_PER_S)


def annotate_costs(gm: fx.GraphModule) -> fx.GraphModule:
    """Fill autopar_flops / autopar_bytes on every node by replaying the graph on fake tensors.

    Needs node.meta["val"] on placeholders (torch.export and make_fx both record it).
    """
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    fake_mode = detect_fake_mode([n.meta.get("val") for n in placeholders])
    if fake_mode is None:
        # Graphs built on real tensors: fake them once, shapes are all we need.
        from torch._subclasses.fake_tensor import FakeTensorMode

        fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    env: dict[fx.Node, object] = {}
    counter = FlopCounterMode(display=False, custom_mapping=_EXTRA_FLOP_RULES)
    with fake_mode, counter:
        for node in gm.graph.nodes:
            if node.op == "placeholder":
                val = node.meta.get("val")
                env[node] = val
                node.meta["autopar_flops"] = 0
                node.meta["autopar_bytes"] = value_bytes(val)
            elif node.op == "call_function":
                args = fx.node.map_arg(node.args, lambda a: env[a])
                kwargs = fx.node.map_arg(node.kwargs, lambda a: env[a])
                before = counter.get_total_flops()
                if node.target is operator.getitem:
                    out = operator.getitem(*args)
                elif "val" in node.meta and is_random(node):
                    out = node.meta["val"]  # don't advance any RNG state while annotating
                else:
                    out = node.target(*args, **kwargs)
                env[node] = _traced_layout(out, node.meta.get("val"))
                routed = moe_dispatch.dispatch_flops(node.target, args)
                node.meta["autopar_flops"] = counter.get_total_flops() - before if routed is None else routed
                node.meta["autopar_bytes"] = value_bytes(out)
            elif node.op == "get_attr":
                env[node] = getattr(gm, node.target)
                node.meta["autopar_flops"] = 0
                node.meta["autopar_bytes"] = 0
    return gm


def _traced_layout(out, traced):
    """``out`` with the strides the capture traced (``traced``: the node's meta['val']).

    A fake replay may lay a value out otherwise than the trace did: SDPA picks its kernel, and
    with it its output layout, from whether the mask requires grad, which export and a replay
    see differently. The graph's later views were recorded for the traced layout (export drops
    a ``.contiguous()`` on what was contiguous then), so the replay continues from a fake tensor
    with the traced strides."""
    if isinstance(out, torch.Tensor):
        if (isinstance(traced, torch.Tensor) and traced.shape == out.shape and traced.stride() != out.stride()
                and traced.layout == torch.strided):
            return torch.empty_strided(traced.shape, traced.stride(), dtype=out.dtype, device=out.device)
        return out
    if isinstance(out, (tuple, list)) and isinstance(traced, (tuple, list)) and len(out) == len(traced):
        return type(out)(_traced_layout(o, t) for o, t in zip(out, traced))
    return out


def is_random(node: fx.Node) -> bool:
    """True when the node draws random numbers (dropout and friends; attention with dropout_p=0 does not)."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return False
    if torch.Tag.nondeterministic_seeded not in target.tags:
        return False
    for i, arg in enumerate(target._schema.arguments):
        if arg.name == "dropout_p":
            value = node.args[i] if i < len(node.args) else node.kwargs.get("dropout_p", arg.default_value)
            return value != 0
    return True


def graph_flops(gm: fx.GraphModule) -> int:
    """FLOPs of the ops a graph runs (a placeholder standing for a value another program
    computed carries that op's meta, not its cost)."""
    return sum(n.meta.get("autopar_flops", 0) for n in gm.graph.nodes if n.op == "call_function")
