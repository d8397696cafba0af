"""Whether the captured loss is a token mean of the target (design.md §5 loss normalization).

``ignore_index_of(captured)`` is the ``ignore_index`` when the graph's loss is exactly one
cross-entropy (``aten.cross_entropy_loss``, or an ``nll_loss`` of log-probabilities) of the
captured target, reshaped or viewed only, with the mean reduction and no class weights: a mean
over the target's entries that are not ``ignore_index``. The runtime then normalizes the step by
the valid entries of the whole global batch (autopar/batches.label_scales) instead of averaging
per-microbatch means. None for every other loss (a sum, class weights, an auxiliary term added,
a target that is sliced or computed): those keep the per-microbatch rule.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from .costs import is_view

aten = torch.ops.aten
_MEAN = 1  # torch's Reduction::Mean
_CASTS = {"_to_copy", "clone", "alias", "to"}


def _through(node: fx.Node, ops: set) -> fx.Node:
    while node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) \
            and node.target._opname in ops and node.all_input_nodes:
        node = node.all_input_nodes[0]
    return node


def ignore_index_of(captured) -> int | None:
    if captured.target is None or not captured.loss:
        return None
    node = _through(captured.node(captured.loss), _CASTS)
    if node.op == "call_function" and node.target is operator.getitem and node.args[1] == 0:
        node = node.args[0]  # nll_loss_forward returns (loss, total_weight)
    if node.op != "call_function":
        return None
    if node.target is aten.cross_entropy_loss.default:
        names = ("input", "target", "weight", "reduction", "ignore_index", "label_smoothing")
        defaults = {"weight": None, "reduction": _MEAN, "ignore_index": -100, "label_smoothing": 0.0}
    elif node.target in (aten.nll_loss_nd.default, aten.nll_loss.default):
        names = ("input", "target", "weight", "reduction", "ignore_index")
        defaults = {"weight": None, "reduction": _MEAN, "ignore_index": -100}
    elif node.target is aten.nll_loss_forward.default:
        names = ("input", "target", "weight", "reduction", "ignore_index")
        defaults = {}
    else:
        return None
    args = {**defaults, **dict(zip(names, node.args)), **node.kwargs}
    if args.get("weight") is not None or args.get("reduction") != _MEAN:
        return None
    target = args["target"]
    while isinstance(target, fx.Node) and target.op == "call_function" and is_view(target) \
            and target.target is not operator.getitem:
        if isinstance(target.target, torch._ops.OpOverload) and target.target._opname in ("slice", "select",
                                                                                            "narrow", "index"):
            return None  # a part of the target: its valid count is not the target's
        target = target.all_input_nodes[0]
    if not isinstance(target, fx.Node) or target.op != "placeholder" or target.name != captured.target:
        return None
    return int(args["ignore_index"])
