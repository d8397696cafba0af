"""Which parameters Muon steps, read from the captured graph (autopar/muon.py).

A parameter is a *hidden matrix* (Muon) when it has 2 or more dims and every use of its value
(through views, casts, copies and expert indexing) is a matmul operand (``linear``, ``mm``,
``bmm``, grouped matmuls, autopar's expert dispatch); the others take AdamW, with the reason:

* ``embedding``: it is looked up (``aten.embedding``), also when tied to the LM head;
* ``lm head``: a matmul whose output reaches the loss without crossing another weight's matmul
  (the LM head, a classifier, a regression head);
* ``router``: a matmul whose output reaches a ``topk`` / ``sort`` / ``argmax`` without
  crossing another weight's matmul (an MoE router);
* ``fewer than 2 dims`` (norms, biases, scales), ``not a matmul operand`` (convolutions,
  learned sinks, expert biases, positions added to activations), ``unused``.

With ``split_heads`` a Muon matrix whose output is reshaped into heads (``[..., heads * d]`` ->
``[..., heads, d]``, directly or after splitting a fused q/k/v along the last dim) is
orthogonalized per head: ``Route.rows = d``.

Both reachability questions are answered in one reverse walk over the graph (linear time).
"""
from __future__ import annotations

import math
import operator
from typing import NamedTuple

import torch
import torch.fx as fx

from . import op_semantics
from .costs import is_view

# ops whose output is the parameter's value moved, cast or selected (expert rows), not computed on
_PASS_THROUGH = {"clone", "contiguous", "_to_copy", "to", "index", "index_select"}
_MATMUL = op_semantics.GEMM_NAMES
_SELECTS = {"topk", "sort", "argsort", "argmax", "argmin", "kthvalue"}
# ops between a projection and its head reshape that keep the last dim's heads intact (a bias add too)
_SPLITS = {"split", "split_with_sizes", "chunk", "unbind", "slice", "add"}
# ops that read only their input's shape, dtype or device: no value flows through them
_SHAPE_ONLY = {"new_zeros", "new_ones", "new_empty", "new_full", "zeros_like", "ones_like", "empty_like",
               "full_like", "sym_size", "sym_numel", "size", "_assert_tensor_metadata"}


class Route(NamedTuple):
    muon: bool
    reason: str
    rows: int = 0   # > 0: orthogonalized in blocks of this many rows (one head each)
    shape: tuple = ()


def _opname(node: fx.Node) -> str:
    t = node.target
    if isinstance(t, torch._ops.OpOverload):
        return t._opname
    return getattr(t, "__name__", str(t))


def _is_matmul(node: fx.Node) -> bool:
    name = _opname(node)
    if name in _MATMUL or "grouped_mm" in name:
        return True
    t = node.target
    return isinstance(t, torch._ops.OpOverload) and t.namespace == "autopar" and "moe_dispatch" in name


def _passes_value(node: fx.Node) -> bool:
    return node.op == "call_function" and (is_view(node) or _opname(node) in _PASS_THROUGH)


def _uses(node: fx.Node) -> list[fx.Node]:
    """The nodes that compute on ``node``'s value (through views, casts and copies)."""
    out, stack = [], list(node.users)
    while stack:
        u = stack.pop()
        if _opname(u) in _SHAPE_ONLY:  # reads no value (deepseek's _assert_tensor_metadata on a router weight)
            continue
        if _passes_value(u):
            stack.extend(u.users)
        else:
            out.append(u)
    return out


def route_parameters(captured, split_heads: bool = False) -> dict[str, Route]:
    """Canonical FQN -> Route for every parameter placeholder of ``captured`` (a CapturedGraph
    or a stage graph with the same ``params`` map), in graph order."""
    graph = captured.gm.graph
    placeholders = {n.name: n for n in graph.nodes if n.op == "placeholder"}
    params = {placeholders[name]: fqn for name, fqn in captured.params.items() if name in placeholders}
    weight_matmuls = {u for p in params for u in _uses(p) if _is_matmul(u)}
    loss = captured.node(captured.loss) if getattr(captured, "loss", None) else None
    reaches_loss, reaches_select = _reach(graph, weight_matmuls, loss)
    routes: dict[str, Route] = {}
    for node, fqn in params.items():
        val = node.meta.get("val")
        ndim = val.dim() if isinstance(val, torch.Tensor) else 0
        uses = _uses(node)
        shape = tuple(val.shape) if isinstance(val, torch.Tensor) else ()
        routes[fqn] = _route(node, uses, ndim, reaches_loss, reaches_select, split_heads)._replace(shape=shape)
    return routes


def _route(node: fx.Node, uses: list[fx.Node], ndim: int, reaches_loss: set, reaches_select: set,
           split_heads: bool) -> Route:
    if any(_opname(u) == "embedding" for u in uses):
        return Route(False, "embedding")
    if ndim < 2:
        return Route(False, "fewer than 2 dims")
    if not uses:
        return Route(False, "unused")
    if not all(_is_matmul(u) for u in uses):
        return Route(False, "not a matmul operand")
    if any(u in reaches_select for u in uses):
        return Route(False, "router")
    if any(u in reaches_loss for u in uses):
        return Route(False, "lm head")
    rows = _head_rows(uses, node.meta["val"].shape[-2]) if split_heads and ndim == 2 else 0
    return Route(True, "matmul operand", rows)


def _reach(graph: fx.Graph, stops: set, loss: fx.Node | None) -> tuple[set, set]:
    """The nodes whose value reaches the loss, and those that reach a top-k style selection,
    along paths that cross no node of ``stops`` after their start."""
    to_loss, to_select = set(), set()
    for node in reversed(graph.nodes):
        if node is loss:
            to_loss.add(node)
        if node.op == "call_function" and _opname(node) in _SELECTS:
            to_select.add(node)
        for u in node.users:
            if u in stops or _opname(u) in _SHAPE_ONLY:
                continue
            if u in to_loss:
                to_loss.add(node)
            if u in to_select:
                to_select.add(node)
    return to_loss, to_select


def _head_rows(uses: list[fx.Node], out_features: int) -> int:
    """The head size ``d`` of a projection (``linear``: the weight is ``[out, in]``) whose output
    is reshaped into ``[..., heads, d]`` (after an optional split of a fused projection along
    the last dim, or views that keep it), else 0."""
    if not all(_opname(u) == "linear" for u in uses):
        return 0
    found = set()
    stack = [(u, 0) for u in uses]
    while stack:
        node, depth = stack.pop()
        for u in node.users:
            name = _opname(u)
            if name in ("view", "reshape", "_unsafe_view"):
                d = _trailing_factor(u)
                if d:
                    found.add(d)
                elif depth < 3 and _keeps_last_dim(u):
                    stack.append((u, depth + 1))
            elif depth < 3 and (u.target is operator.getitem or name in _SPLITS):
                stack.append((u, depth + 1))
    if len(found) != 1:
        return 0
    d = found.pop()
    return d if out_features % d == 0 and d < out_features else 0


def _keeps_last_dim(view: fx.Node) -> bool:
    src, out = view.all_input_nodes[0].meta.get("val"), view.meta.get("val")
    return isinstance(src, torch.Tensor) and isinstance(out, torch.Tensor) and src.dim() >= 1 and out.dim() >= 1 \
        and src.shape[-1] == out.shape[-1]


def _trailing_factor(view: fx.Node) -> int:
    """``d`` when the view splits its input's last dim L into trailing dims ``(..., d)`` (2 or
    more of them, product L), else 0."""
    src, out = view.all_input_nodes[0].meta.get("val"), view.meta.get("val")
    if not isinstance(src, torch.Tensor) or not isinstance(out, torch.Tensor) or out.dim() < 2 or src.dim() < 1:
        return 0
    last = src.shape[-1]
    for k in range(2, out.dim() + 1):
        if math.prod(out.shape[-k:]) == last:
            return int(out.shape[-1])
        if math.prod(out.shape[-k:]) > last:
            break
    return 0
