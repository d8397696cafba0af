"""Spread each MoE dispatch chain over its program, so its all-to-alls fly while other work runs.

A dropless MoE block is a chain of three graph ops (passes/moe_dispatch.py), in F

    moe_dispatch_send (start the rows' all-to-all) -> moe_dispatch_experts (wait; the local
    experts; start the return) -> moe_dispatch (wait; the block's output)

and the same shape in I (``grad_send -> grad_input -> grad_combine``). As captured, the three
ops follow each other, so every all-to-all is waited on right after it starts. This pass moves,
inside one region of the joint graph (F's nodes, or I's):

* the start op up, to just after the last of its inputs;
* the finish op (and the results taken from it) down, to just before the first node that
  reads them;
* the middle op to the point of the window between them (the region's other nodes, which do
  not depend on the chain: a shared expert, the attention of a block whose output the MoE does
  not read, their input gradients in I) where half of the window's FLOPs lie before it, never
  before its own inputs: the first all-to-all hides behind the first half, the return behind
  the second.

Order only: no value changes, so the run stays exact. Every rank of an EP group runs the same
programs, so the collectives keep one order on the group. What each all-to-all can hide
behind is written on the chain's output node, ``node.meta["autopar_moe_overlap"] =
{"F": (flops before the middle op, flops after), "I": (...)}``; ``moe_dispatch.routed_info``
reads it for the planner, which prices as exposed only the all-to-all time those FLOPs do
not cover (planner/time_model.py). On CUDA the all-to-alls run on NCCL's stream and the window's
kernels on the compute stream; on CPU gloo runs them on its own threads.
"""
from __future__ import annotations

import operator

import torch.fx as fx

from .moe_dispatch import BACKWARD_OPS, FORWARD_OPS

META = "autopar_moe_overlap"
_START_OF = {FORWARD_OPS[1]: 0, BACKWARD_OPS[1]: 0}  # middle op -> argument holding the start's handle
_MIDDLE_OF = {FORWARD_OPS[2]: 8, BACKWARD_OPS[2]: 0}  # finish op -> argument holding the middle's handle


def spread_dispatch_chains(graph: fx.Graph, region: set[fx.Node], phase: str) -> int:
    """Spread every chain whose finish op lies in ``region`` (``phase``: "F" or "I", the key of
    the record); returns how many. Nodes outside the region never move past region nodes in a
    way that matters: programs are cut out of the joint graph by region, in its order."""
    finishes = [n for n in graph.nodes if n in region and n.op == "call_function" and n.target in _MIDDLE_OF]
    for fin in finishes:
        mid = fin.args[_MIDDLE_OF[fin.target]]
        start = mid.args[_START_OF[mid.target]]
        if not (mid in region and start in region):
            continue
        _hoist(graph, start)
        _sink(fin)
        before, after = _place_middle(graph, start, mid, fin, region)
        _forward_chain_output(fin).meta.setdefault(META, {})[phase] = (before, after)
    return len(finishes)


def _position(graph: fx.Graph) -> dict[fx.Node, int]:
    return {n: i for i, n in enumerate(graph.nodes)}


def _hoist(graph: fx.Graph, node: fx.Node) -> None:
    pos = _position(graph)
    inputs = node.all_input_nodes
    if not inputs:
        return
    latest = max(inputs, key=pos.__getitem__)
    if latest.op == "placeholder":  # stay behind every placeholder
        latest = [n for n in graph.nodes if n.op == "placeholder"][-1]
    if pos[latest] + 1 < pos[node]:
        latest.append(node)


def _is_check(node: fx.Node) -> bool:
    """A metadata assertion (``aten._assert_tensor_metadata`` of a ``.to``): reads, computes nothing."""
    return node.op == "call_function" and str(node.target).startswith("aten._assert") and not node.users


def _sink(node: fx.Node) -> None:
    """``node``, its getitems and the checks of their values to just before the first node
    reading their values."""
    pos = _position(node.graph)
    items = [u for u in node.users if u.target is operator.getitem]
    readers = [u for u in node.users if u.target is not operator.getitem]
    readers += [r for g in items for r in g.users]
    checks = [r for r in readers if _is_check(r)]
    readers = [r for r in readers if not _is_check(r)]
    if not readers:
        return
    first = min(readers, key=pos.__getitem__)
    first.prepend(node)
    for g in sorted(items + checks, key=pos.__getitem__):
        first.prepend(g)


def _place_middle(graph: fx.Graph, start: fx.Node, mid: fx.Node, fin: fx.Node, region: set) -> tuple[int, int]:
    """Put ``mid`` after half the window's FLOPs (not before its inputs); the FLOPs of the
    region's window before and after it."""
    nodes = list(graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    window = [n for n in nodes[pos[start] + 1: pos[fin]] if n is not mid]
    flops = [n.meta.get("autopar_flops", 0) if n in region else 0 for n in window]
    latest_input = max(pos[a] for a in mid.all_input_nodes)
    total, acc, anchor = sum(flops), 0, nodes[latest_input]
    for n, f in zip(window, flops):
        acc += f
        if pos[n] >= latest_input and acc * 2 >= total:
            anchor = n
            break
    anchor.append(mid)
    before = sum(f for n, f in zip(window, flops) if pos[n] <= pos[anchor])
    return before, total - before


def _forward_chain_output(fin: fx.Node) -> fx.Node:
    """The forward ``moe_dispatch`` node of a chain (a backward chain's: the op whose handle its
    start reads)."""
    if fin.target is FORWARD_OPS[2]:
        return fin
    start = fin.args[0].args[0]  # grad_combine <- grad_input <- grad_send
    handle = start.args[1]  # getitem(moe_dispatch, 1)
    return handle.args[0] if handle.target is operator.getitem else handle
