"""Context parallelism's rewrite of the analysed graph (under the graph's fake mode): the
Ulysses all-to-alls around each attention, masks rebuilt for the whole sequence, positions
offset to the rank's shard (passes/context_parallel.py describes the pass)."""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from .cp_regions import _get_loc, _inputs_of, _set_loc, _slice_start, _table_slice
from .cp_rules import (
    _ABS,
    _ARANGE,
    _ASSERT,
    _KV,
    _Q,
    _SIZED,
    _arg,
    _Attention,
    _grouped,
    _has_arg,
    _Mask,
    _Plan,
    _set_arg,
    kv_repeats,
)

aten = torch.ops.aten
_c10d = torch.ops._c10d_functional


# ---------------------------------------------------------------------------------------------
# rewriting (called under the graph's fake mode: every new node gets meta["val"])


def _new(graph: fx.Graph, target, args: tuple, like: fx.Node, kwargs: dict | None = None) -> fx.Node:
    node = graph.call_function(target, args, kwargs or {})
    vals = fx.node.map_arg(args, lambda a: a.meta["val"])
    kvals = fx.node.map_arg(kwargs or {}, lambda a: a.meta["val"])
    node.meta["val"] = target(*vals, **kvals)
    for key in ("nn_module_stack", "stack_trace", "source_fn_stack", "from_node"):
        if key in like.meta:
            node.meta[key] = like.meta[key]
    return node


def _refresh(node: fx.Node) -> None:
    vals = fx.node.map_arg(node.args, lambda a: a.meta["val"])
    kvals = fx.node.map_arg(node.kwargs, lambda a: a.meta["val"])
    node.meta["val"] = node.target(*vals, **kvals)


class _Rewriter:
    def __init__(self, graph: fx.Graph, plan: _Plan, cp: int, cp_rank: int, s: int, group_name: str):
        self.graph, self.plan, self.cp, self.rank, self.s, self.group = graph, plan, cp, cp_rank, s, group_name
        self.built: dict = {}      # (node, roles, a, b) -> copy
        self.full: dict = {}       # mask out -> [.., S, S] mask
        self.narrowed: dict = {}   # (value, heads) -> head shard
        self.gathered: dict = {}   # input placeholder -> [B, S, ...]

    # -- attention ---------------------------------------------------------------------------

    def attention(self, att: _Attention) -> None:
        g, cp = self.graph, self.cp
        if att.kind == "sdpa":
            node = att.node
            for consumer, name, mask in att.masks:
                x = _arg(node, name)
                if mask is not None and mask.causal and name == "attn_mask":
                    _set_arg(node, "attn_mask", None)
                    _set_arg(node, "is_causal", True)
                    continue
                with g.inserting_before(node):
                    _set_arg(node, name, self.side(x, mask, att.heads, node))
            _rewrite_sdpa(g, node, cp, self.group)
            return
        scores, pv = att.region[0], att.region[-1]
        with g.inserting_before(scores):
            q = _seq_to_heads(g, att.q, cp, self.group, scores)
            k = _new(g, aten.transpose.int, (att.k, 2, 3), scores)
            k = _seq_to_heads(g, k, cp, self.group, scores)
            k = _new(g, aten.transpose.int, (k, 2, 3), scores)
        scores.args = (q, k) + tuple(scores.args[2:])
        for consumer, i, mask in att.masks:
            with g.inserting_before(consumer):
                _set_loc(consumer, i, self.side(_get_loc(consumer, i), mask, att.heads, consumer))
        for consumer, i in att.sides:  # per-head extra logits of the local queries: to the rank's heads, all queries
            with g.inserting_before(consumer):
                _set_loc(consumer, i, _seq_to_heads(g, _get_loc(consumer, i), cp, self.group, consumer))
        for node, offset in att.slices:
            node.args = (node.args[0], _arg(node, "dim"), offset, offset + cp * self.s, 1)
        with g.inserting_before(pv):
            v = _seq_to_heads(g, att.v, cp, self.group, pv)
        pv.args = (pv.args[0], v) + tuple(pv.args[2:])
        out_val = pv.meta["val"]
        for node in att.region:
            for u in list(node.users):
                if u.target is _ASSERT and (_arg(u, "size") is not None or _arg(u, "stride") is not None):
                    g.erase_node(u)
            _refresh(node)
        users = list(pv.users)
        with g.inserting_before(pv.next):
            back = _heads_to_seq(g, pv, cp, self.group, pv, tuple(out_val.stride()))
        for u in users:
            u.replace_input_with(pv, back)

    def side(self, x: fx.Node, mask: _Mask | None, heads: int, like: fx.Node) -> fx.Node:
        """A mask/bias tensor of the scores, for the whole sequence and this rank's heads."""
        if mask is not None:
            x = self.full_mask(mask)
        val = x.meta["val"]
        hd = val.dim() - 3
        if hd >= 0 and val.shape[hd] == heads and heads > 1:
            key = (x, heads)
            if key not in self.narrowed:
                h = heads // self.cp
                self.narrowed[key] = _new(self.graph, aten.narrow.default, (x, hd, self.rank * h, h), like)
            x = self.narrowed[key]
        return x

    # -- masks -------------------------------------------------------------------------------

    def full_mask(self, mask: _Mask) -> fx.Node:
        if mask.out in self.full:
            return self.full[mask.out]
        cp, g = self.cp, self.graph
        val = mask.out.meta["val"]
        with g.inserting_before(mask.out):
            qs = range(cp) if _Q in mask.uses else [None]
            kvs = range(cp) if _KV in mask.uses else [None]
            rows = []
            for a in qs:
                cols = [self.build(mask.out, mask.roles, a, b) for b in kvs]
                if mask.roles[-1] == _KV and len(cols) == 1:
                    cols = cols * cp  # the same along the keys: repeat
                rows.append(cols[0] if len(cols) == 1 else _new(g, aten.cat.default, (cols, -1), mask.out))
            if val.dim() >= 2 and mask.roles[-2] == _Q and len(rows) == 1:
                rows = rows * cp
            full = rows[0] if len(rows) == 1 else _new(g, aten.cat.default, (rows, -2), mask.out)
        self.full[mask.out] = full
        return full

    def build(self, node: fx.Node, r, a, b) -> fx.Node:
        """A copy of mask node `node` whose dims have roles `r`, for query block a, key block b."""
        uses = self.plan.roles[(node, r)]
        key = (node, r, a if _Q in uses else None, b if _KV in uses else None)
        if key in self.built:
            return self.built[key]
        g, s = self.graph, self.s
        block = {_Q: a, _KV: b}
        if node.op == "placeholder":
            out = node
            if r is not None and node in self.plan.inputs:
                full = self.gather(node)
                out = full if r[1] == _ABS else _new(g, aten.narrow.default, (full, 1, block[r[1]] * s, s), node)
        elif node.target in _ARANGE:
            role = r[0] if r else None
            start = _arg(node, "start") if _has_arg(node, "start") else 0
            kwargs = dict(node.kwargs)
            kwargs["dtype"] = node.meta["val"].dtype
            if role in (_Q, _KV):
                out = _new(g, aten.arange.start, (start + block[role] * s, start + (block[role] + 1) * s), node,
                           kwargs)
            elif role == _ABS and uses:  # positions read by position: those of the whole sequence
                out = _new(g, aten.arange.start, (start, start + self.cp * s), node, kwargs)
            else:
                out = _new(g, node.target, node.args, node, dict(node.kwargs))
        else:
            if node.target is aten.slice.Tensor and r is not None and _table_slice(node, self.plan.state, s):
                d = _arg(node, "dim") % node.meta["val"].dim()
                x = self.build(node.args[0], r[:d] + (None,) + r[d + 1:], a, b)
                start = _slice_start(node) + (0 if r[d] == _ABS else block[r[d]] * s)
                n = self.cp * s if r[d] == _ABS else s
                out = _new(g, aten.slice.Tensor, (x, d, start, start + n, 1), node)
            else:
                ins = {}
                for x, rx in _inputs_of(node, r, s):
                    ins.setdefault(x, self.build(x, rx, a, b))
                args = list(fx.node.map_arg(node.args, lambda x: ins.get(x, x)))
                kwargs = fx.node.map_arg(node.kwargs, lambda x: ins.get(x, x))
                if r is not None and _ABS in r:  # dims read whole that are the sequence: sizes s -> S
                    whole = [d for d, x in enumerate(r) if x == _ABS and node.meta["val"].shape[d] == s]
                    if node.target in _SIZED and whole:
                        i = _SIZED[node.target]
                        size = list(args[i])
                        for d in whole:
                            size[d] = self.cp * s if size[d] == s else size[d]
                        args[i] = size
                    elif node.target is aten.slice.Tensor and (_arg(node, "dim") % len(r)) in whole:
                        args = [args[0], _arg(node, "dim"), 0, None, 1]  # a no-op slice stays one
                out = _new(g, node.target, tuple(args), node, dict(kwargs))
        self.built[key] = out
        return out

    def gather(self, node: fx.Node) -> fx.Node:
        """Model input [B, s, ...] -> [B, S, ...]: all-gather over the cp group, blocks in rank order."""
        if node in self.gathered:
            return self.gathered[node]
        g, cp = self.graph, self.cp
        val = node.meta["val"]
        x = node
        if val.dtype == torch.bool:  # gloo does not reduce or gather bool
            x = _new(g, aten._to_copy.default, (x,), node, {"dtype": torch.uint8})
        x = _new(g, aten.clone.default, (x,), node, {"memory_format": torch.contiguous_format})
        x = _new(g, _c10d.all_gather_into_tensor.default, (x, cp, self.group), node)
        x = _new(g, _c10d.wait_tensor.default, (x,), node)            # [cp * B, s, ...], rank blocks first
        b, rest = val.shape[0], list(val.shape[1:])
        x = _new(g, aten.view.default, (x, [cp, b] + rest), node)
        x = _new(g, aten.transpose.int, (x, 0, 1), node)               # [B, cp, s, ...]
        x = _new(g, aten.clone.default, (x,), node, {"memory_format": torch.contiguous_format})
        x = _new(g, aten.view.default, (x, [b, cp * rest[0]] + rest[1:]), node)
        if val.dtype == torch.bool:
            x = _new(g, aten._to_copy.default, (x,), node, {"dtype": torch.bool})
        self.gathered[node] = x
        return x

    def erase_dead_masks(self) -> None:
        for node in reversed(list(self.graph.nodes)):
            if node in self.plan.erase:
                for u in list(node.users):
                    if u.target is _ASSERT:
                        self.graph.erase_node(u)
                assert not node.users, f"mask node {node.name} still used by {list(node.users)}"
                self.graph.erase_node(node)


def _all_to_all(graph: fx.Graph, x: fx.Node, cp: int, group_name: str, like: fx.Node) -> fx.Node:
    """All-to-all over dim 0 (size cp, one slice per rank) of a contiguous tensor."""
    splits = [1] * cp
    sent = _new(graph, _c10d.all_to_all_single.default, (x, splits, splits, group_name), like)
    return _new(graph, _c10d.wait_tensor.default, (sent,), like)


def _seq_to_heads(graph, x: fx.Node, cp: int, group_name: str, like: fx.Node) -> fx.Node:
    """[B, H, s, D] sequence shard -> [B, H/cp, S, D] head shard (sequence blocks in rank order)."""
    b, h, s, d = x.meta["val"].shape
    t = _new(graph, aten.view.default, (x, [b, cp, h // cp, s, d]), like)   # splitting a dim: always a view
    t = _new(graph, aten.permute.default, (t, [1, 0, 2, 3, 4]), like)       # [cp (dest rank), B, H/cp, s, D]
    t = _new(graph, aten.clone.default, (t,), like, {"memory_format": torch.contiguous_format})
    t = _all_to_all(graph, t, cp, group_name, like)                           # [cp (source rank = seq block), ...]
    t = _new(graph, aten.permute.default, (t, [1, 2, 0, 3, 4]), like)       # [B, H/cp, cp, s, D]
    t = _new(graph, aten.clone.default, (t,), like, {"memory_format": torch.contiguous_format})
    return _new(graph, aten.view.default, (t, [b, h // cp, cp * s, d]), like)


def _repeat_heads(graph, x: fx.Node, repeats: int, like: fx.Node) -> fx.Node:
    """[B, H, s, D] -> [B, H * repeats, s, D], head j of the result is head j // repeats of x (the
    grouped-query order); its backward sums the copies' gradients."""
    b, h, s, d = x.meta["val"].shape
    t = _new(graph, aten.unsqueeze.default, (x, 2), like)
    t = _new(graph, aten.expand.default, (t, [b, h, repeats, s, d]), like)
    t = _new(graph, aten.clone.default, (t,), like, {"memory_format": torch.contiguous_format})
    return _new(graph, aten.view.default, (t, [b, h * repeats, s, d]), like)


def _heads_to_seq(graph, y: fx.Node, cp: int, group_name: str, like: fx.Node, strides: tuple[int, ...]) -> fx.Node:
    """[B, H/cp, S, D] head shard -> [B, H, s, D] sequence shard, laid out with `strides` (those of
    the attention output it replaces: later views in the graph were traced against them)."""
    b, hl, full, d = y.meta["val"].shape
    s = full // cp
    t = _new(graph, aten.view.default, (y, [b, hl, cp, s, d]), like)
    t = _new(graph, aten.permute.default, (t, [2, 0, 1, 3, 4]), like)       # [cp (dest = seq block), B, H/cp, s, D]
    t = _new(graph, aten.clone.default, (t,), like, {"memory_format": torch.contiguous_format})
    t = _all_to_all(graph, t, cp, group_name, like)                           # [cp (source rank = head group), ...]
    # logical [B, cp, H/cp, s, D]; memory order of the original [B, H, s, D] output, H split in two
    shape4 = [b, cp * hl, s, d]
    order4 = sorted(range(4), key=lambda i: (-strides[i], i))  # outermost dim first
    expand = {0: [1], 1: [0, 2], 2: [3], 3: [4]}  # 4-d dim -> 5-d dims of [cp, B, H/cp, s, D]
    order5 = [j for i in order4 for j in expand[i]]
    t = _new(graph, aten.permute.default, (t, order5), like)
    t = _new(graph, aten.clone.default, (t,), like, {"memory_format": torch.contiguous_format})
    t = _new(graph, aten.view.default, (t, [shape4[i] for i in order4]), like)
    if order4 != list(range(4)):
        inverse = [order4.index(i) for i in range(4)]
        t = _new(graph, aten.permute.default, (t, inverse), like)
    return t


def _rewrite_sdpa(graph: fx.Graph, node: fx.Node, cp: int, group_name: str) -> None:
    old_val = node.meta["val"]
    out_val = old_val if isinstance(old_val, torch.Tensor) else old_val[0]
    converted: dict[fx.Node, fx.Node] = {}
    repeats = kv_repeats(int(node.args[1].meta["val"].shape[1]), cp) if _grouped(node) else 1
    with graph.inserting_before(node):
        for i, x in enumerate(node.args[:3]):
            if x not in converted:  # self-attention may pass one tensor as q, k and v
                y = _repeat_heads(graph, x, repeats, node) if i and repeats > 1 else x
                converted[x] = _seq_to_heads(graph, y, cp, group_name, node)
    node.args = tuple(converted[x] for x in node.args[:3]) + tuple(node.args[3:])
    _refresh(node)
    if isinstance(old_val, torch.Tensor):
        out = node
    else:
        getters = [u for u in node.users if u.target is operator.getitem]
        for g in getters:
            if g.args[1] != 0:
                graph.erase_node(g)  # unused (checked): stale shapes otherwise
        out = next((g for g in getters if g.args[1] == 0), None)
        if out is None:
            return
        out.meta["val"] = node.meta["val"][0]
    users = list(out.users)
    with graph.inserting_before(out.next):  # (inserting_after would stack the new nodes in reverse)
        back = _heads_to_seq(graph, out, cp, group_name, node, tuple(out_val.stride()))
    for u in users:
        u.replace_input_with(out, back)


def _offset_arange(node: fx.Node, start: int, s: int) -> None:
    val = node.meta["val"]
    kwargs = {k: v for k, v in node.kwargs.items()}
    kwargs["dtype"] = val.dtype  # integer bounds would otherwise turn a float arange into int64
    node.target = aten.arange.start
    node.args = (start, start + s)
    node.kwargs = kwargs
    node.meta["val"] = node.target(*node.args, **kwargs)


def _offset_slice(node: fx.Node, start: int, s: int) -> None:
    args = list(node.args) + [None] * (5 - len(node.args))
    args[1] = _arg(node, "dim")
    args[2], args[3], args[4] = start, start + s, 1
    node.args = tuple(args)
    node.kwargs = {}
    node.meta["val"] = node.target(node.args[0].meta["val"], *node.args[1:])
