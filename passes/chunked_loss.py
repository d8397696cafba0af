"""Chunked cross-entropy: the LM head and its loss, rewritten to never hold the whole logits.

A language model's last stage computes ``logits = linear(h, W)`` (``[tokens, vocab]``, often
cast to fp32 first) and reduces it to one number with ``cross_entropy``. Forward and backward
then hold that tensor and its gradient: 150k vocabulary × 8k tokens is ~5 GB each in fp32.
This pass finds the pattern in a stage graph as user code and transformers emit it,

    linear(h, W[, b]) -> layout ops on the token dims (view/reshape that keep the vocab dim,
    slices of token dims, clone, alias) and element-wise ops with one constant (cast, mul, div,
    tanh: scaling and soft-capping), in any order -> cross_entropy_loss(x, target,
    weight=None, ignore_index, label_smoothing=0, reduction=mean|sum|none)

and replaces it by ``autopar::linear_ce_forward`` (autopar/linear_ce.py) on the hidden states
laid out the same way (the layout ops applied to ``h``; they commute with element-wise ops),
followed by the reduction as ordinary graph ops (sum of the per-token losses, divided by the
valid-target count for ``mean``). Label shifting, ``num_items_in_batch`` divisions and
everything else stay as they were. Any other shape of loss is left unchanged. The op computes
the hidden states' gradient in the forward (I only scales it); the head's weight gradient is a
separate op that recomputes the chunk logits, so it lands in W (deferrable).

Under tensor parallelism the head is vocabulary-parallel and its loss is
``autopar::vocab_cross_entropy`` (passes/tensor_parallel.py): the same pattern ending in it is
chunked too, the op reducing each chunk's row max, sum of exponentials and target logit over the
tp group (autopar/linear_ce.py), so neither the logits nor a chunk of them is ever gathered.

Numerics: the per-token losses and their sum are fp32 (cast to the logits' dtype at the end,
as the loss was); equal to the unchunked graph to fp32 rounding.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import operator

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode

from autopar import linear_ce

from .costs import annotate_costs, graph_flops, node_time
from .tp_ops import VOCAB_CE

log = logging.getLogger("autopar")
aten = torch.ops.aten

_LAYOUT = {aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.slice.Tensor, aten.clone.default,
           aten.alias.default, aten.contiguous.default}
_SCALAR_OPS = {aten.mul.Tensor: "mul", aten.mul.Scalar: "mul", aten.div.Tensor: "div", aten.div.Scalar: "div"}
_ASSERTS = {aten._assert_tensor_metadata.default}
_REDUCTIONS = {0: "none", 1: "mean", 2: "sum"}


@dataclasses.dataclass(frozen=True)
class LinearLoss:
    """One head + cross-entropy found in a graph: what the rewrite and the planner read."""

    loss: fx.Node          # the cross_entropy_loss node (or tensor parallelism's vocab_cross_entropy)
    head: fx.Node          # the linear node
    chain: tuple           # nodes between them, head side first
    tokens: int            # rows of the logits the loss reads
    hidden: int            # d
    vocab: int             # V (this rank's classes under tensor parallelism)
    result: fx.Node = None  # the loss's value (vocab_cross_entropy: its first output)
    group: str = ""        # the vocabulary is sharded over this process group (tensor parallelism)
    start: int = 0         # ... and the head holds the classes [start, start + vocab)


def find_linear_losses(gm: fx.GraphModule) -> list[LinearLoss]:
    """Every ``linear -> ... -> cross_entropy_loss`` of ``gm`` this pass can chunk."""
    found = []
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in (aten.cross_entropy_loss.default, VOCAB_CE):
            m = _match(node)
            if m is not None:
                found.append(m)
    return found


def _arg(node: fx.Node, name: str):
    for i, a in enumerate(node.target._schema.arguments):
        if a.name == name:
            if i < len(node.args):
                return node.args[i]
            return node.kwargs.get(name, a.default_value)
    raise KeyError(name)


def _val(node):
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def _sole_user(node: fx.Node, user: fx.Node) -> bool:
    return all(u is user or u.target in _ASSERTS for u in node.users)


def _loss_args(ce: fx.Node) -> dict | None:
    """The logits, target, ignore_index and reduction a loss node reads, the value its users
    read, and where its classes are sharded: None for a loss the rewrite cannot take."""
    if ce.target is VOCAB_CE:  # (logits, target, group, start, ignore_index, reduction) -> (loss, lse)
        users = list(ce.users)
        if len(users) != 1 or users[0].target is not operator.getitem or users[0].args[1] != 0:
            return None
        x, target, group, start, ignore, reduction = ce.args
        return dict(x=x, target=target, group=group, start=start, ignore=ignore, reduction=reduction,
                    result=users[0])
    if _arg(ce, "weight") is not None or _arg(ce, "label_smoothing") != 0.0:
        return None
    return dict(x=_arg(ce, "self"), target=_arg(ce, "target"), group="", start=0, ignore=_arg(ce, "ignore_index"),
                reduction=_arg(ce, "reduction"), result=ce)


def _match(ce: fx.Node) -> LinearLoss | None:
    args = _loss_args(ce)
    if args is None:
        return None
    x, target = args["x"], args["target"]
    xv, tv = _val(x), _val(target)
    if xv is None or tv is None or xv.dim() != 2 or tv.dim() != 1:
        return None
    chain, cur, user = [], x, ce
    while isinstance(cur, fx.Node) and cur.op == "call_function" and cur.target is not aten.linear.default:
        if not _sole_user(cur, user) or not _chain_op(cur):
            return None
        chain.append(cur)
        user, cur = cur, cur.args[0]
    if not (isinstance(cur, fx.Node) and cur.op == "call_function" and _sole_user(cur, user)):
        return None
    h, w = cur.args[0], cur.args[1]
    hv, wv = _val(h), _val(w)
    if hv is None or wv is None or wv.dim() != 2 or not hv.is_floating_point():
        return None
    return LinearLoss(loss=ce, head=cur, chain=tuple(reversed(chain)), tokens=int(xv.shape[0]),
                      hidden=int(wv.shape[1]), vocab=int(wv.shape[0]), result=args["result"], group=args["group"],
                      start=int(args["start"]))


def _chain_op(node: fx.Node) -> bool:
    """An op between the head and the loss that the rewrite can move: a layout op on the token
    dims (the vocab dim, last, kept whole) or an element-wise op with one constant."""
    v_in, v_out = _val(node.args[0]), _val(node)
    if not isinstance(v_in, torch.Tensor) or not isinstance(v_out, torch.Tensor):
        return False
    t = node.target
    if t in _LAYOUT:
        if v_in.shape[-1] != v_out.shape[-1]:
            return False
        if t is aten.slice.Tensor:
            dim = node.args[1] if len(node.args) > 1 else 0
            return dim % v_in.dim() != v_in.dim() - 1
        return True
    if t in _SCALAR_OPS:
        return len(node.args) == 2 and isinstance(node.args[1], (int, float)) and not node.kwargs
    if t is aten.tanh.default:
        return True
    if t is aten._to_copy.default:
        return set(node.kwargs) <= {"dtype"} and v_in.device == v_out.device
    return False


def chunk_losses(gm: fx.GraphModule, chunk_tokens: int) -> tuple[fx.GraphModule, int]:
    """A copy of ``gm`` with every matched head + loss chunked at ``chunk_tokens`` tokens, and
    how many were; ``gm`` itself is unchanged."""
    graph = fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    new = fx.GraphModule(gm, graph, class_name=type(gm).__name__)
    new.meta.update(gm.meta)
    matches = find_linear_losses(new)
    for m in matches:
        _rewrite(new.graph, m, chunk_tokens)
    if matches:
        new.graph.lint()
        new.recompile()
        annotate_costs(new)
    return new, len(matches)


def chunk_stage_loss(stage, chunk_tokens: int):
    """The stage (passes/split_stages.StageGraph) with its loss chunked, or the stage itself
    when it has no loss, ``chunk_tokens`` is 0 or nothing matches."""
    if not chunk_tokens or not stage.has_loss:
        return stage
    gm, n = chunk_losses(stage.gm, chunk_tokens)
    if not n:
        log.info("autopar: stage %d: no linear head + cross_entropy to chunk; its loss runs as written", stage.index)
        return stage
    log.info("autopar: stage %d: %d cross-entropy loss(es) chunked at %d tokens", stage.index, n, chunk_tokens)
    cost = sum(node_time(node) for node in gm.graph.nodes)
    return dataclasses.replace(stage, gm=gm, cost=cost, flops=graph_flops(gm))


def _rewrite(graph: fx.Graph, m: LinearLoss, chunk_tokens: int) -> None:
    ce, head = m.loss, m.head
    h, w = head.args[0], head.args[1]
    bias = head.args[2] if len(head.args) > 2 else head.kwargs.get("bias")
    d = m.hidden
    ops, values = [], []
    fake = detect_fake_mode([_val(h), _val(w)]) or contextlib.nullcontext()
    with graph.inserting_before(ce):
        x = h
        for node in m.chain:
            t = node.target
            if t in (aten.view.default, aten._unsafe_view.default, aten.reshape.default):
                shape = list(node.args[1])
                x = _add(graph, fake, t, (x, shape[:-1] + [d]), node)
            elif t in (aten.slice.Tensor, aten.clone.default, aten.alias.default, aten.contiguous.default):
                x = _add(graph, fake, t, (x, *node.args[1:]), node, dict(node.kwargs))
            elif t in _SCALAR_OPS:
                ops.append(_SCALAR_OPS[t])
                values.append(float(node.args[1]))
            elif t is aten.tanh.default:
                ops.append("tanh")
                values.append(0.0)
            elif t is aten._to_copy.default:
                ops.append(f"to:{str(node.kwargs['dtype']).removeprefix('torch.')}")
                values.append(0.0)
        args = _loss_args(ce)
        target, ignore = args["target"], int(args["ignore"])
        res = _add(graph, fake, linear_ce.FORWARD_OP, (x, w, bias, target, ignore, int(chunk_tokens), ",".join(ops),
                                                        values, m.group, m.start), ce)
        loss_tok = _add(graph, fake, operator.getitem, (res, 0), ce)
        reduction = _REDUCTIONS[int(args["reduction"])]
        out = loss_tok
        if reduction != "none":
            out = _add(graph, fake, aten.sum.default, (loss_tok,), ce)
        if reduction == "mean":
            valid = _add(graph, fake, aten.ne.Scalar, (target, ignore), ce)
            count = _add(graph, fake, aten.sum.default, (valid,), ce)
            out = _add(graph, fake, aten.div.Tensor, (out, count), ce)
        dtype = _val(m.result).dtype
        if dtype != torch.float32:
            out = _add(graph, fake, aten._to_copy.default, (out,), ce, {"dtype": dtype})
    m.result.replace_all_uses_with(out)
    for node in [*([m.result] if m.result is not ce else []), ce, *reversed(m.chain), head]:
        for u in list(node.users):
            if u.target in _ASSERTS:
                graph.erase_node(u)
        graph.erase_node(node)


def _add(graph: fx.Graph, fake, target, args: tuple, like: fx.Node, kwargs: dict | None = None) -> fx.Node:
    """A new node computing ``target(*args, **kwargs)``, with its fake value and ``like``'s
    source meta (stack trace, module path)."""
    node = graph.call_function(target, args, kwargs or {})
    for k in ("stack_trace", "nn_module_stack", "source_fn_stack", "from_node"):
        if k in like.meta:
            node.meta[k] = like.meta[k]
    vals_args = fx.node.map_arg(args, _val)
    vals_kwargs = fx.node.map_arg(kwargs or {}, _val)
    with fake:
        node.meta["val"] = target(*vals_args, **vals_kwargs)
    return node
