"""Context parallelism's analysis of attention written out in ops (a *region*: scores by matmul,
softmax, probabilities by matmul) and of the masks and position tables attention reads: the
role of each dim along the sequence (query position, key position, absolute index), whether a
mask is causal, and where positions are picked (passes/context_parallel.py describes the pass)."""
from __future__ import annotations

import math
import operator

import torch
import torch.fx as fx

from .captured import CapturedGraph
from .cp_rules import (
    _ABS,
    _ARANGE,
    _ASSERT,
    _DROPOUT,
    _FACTORY,
    _KV,
    _LIKE,
    _MATMUL,
    _Q,
    _REDUCE,
    _ROW_REDUCE,
    _SHAPE_ONLY,
    _TABLE_CHAIN,
    _VIEWS,
    _arg,
    _Attention,
    _check_qkv,
    _elementwise,
    _error,
    _has_arg,
    _Mask,
    _op_name,
    _where,
)

aten = torch.ops.aten


def _region_op(node: fx.Node) -> bool:
    """Ops a region may hold between the score matmul and the value matmul (checked further there)."""
    t = node.target
    if node.op != "call_function":
        return False
    if t is operator.getitem:
        return getattr(node.args[0], "target", None) in (aten.max.dim, aten.native_dropout.default)
    return _elementwise(t) or t in _DROPOUT or t in _ROW_REDUCE or t is aten.cat.default


def _score_search(softmax: fx.Node, s: int, dep: set):
    """Walk back from the softmax through region ops and activations: (score matmuls [.., s, s]
    reached, nodes passed, the nearest activation op that stopped the walk)."""
    seen, queue, matmuls, blocked = set(), [softmax.args[0]], [], None
    while queue:
        n = queue.pop(0)
        if not isinstance(n, fx.Node) or n in seen:
            continue
        seen.add(n)
        val = n.meta.get("val")
        if n.target in _MATMUL and isinstance(val, torch.Tensor) and val.dim() == 4 and tuple(val.shape[-2:]) == (s, s):
            matmuls.append(n)
        elif _region_op(n):
            queue.extend(a for a in n.all_input_nodes if a in dep)
        elif blocked is None and n in dep:
            blocked = n
    return matmuls, seen, blocked


def _hidden_scores(node: fx.Node, s: int, dep: set, limit: int = 32) -> fx.Node | None:
    """A 4-d score matmul [.., s, s] behind `node` through any ops on per-(batch, head, query)
    values ([B, H, s, *]), or None (a bounded search: the attention of an earlier layer lies behind
    [B, s, hidden] activations, which stop it)."""
    seen, queue = set(), [node]
    while queue and len(seen) < limit:
        n = queue.pop(0)
        if n in seen:
            continue
        seen.add(n)
        val = n.meta.get("val")
        if not (isinstance(val, torch.Tensor) and val.dim() == 4 and val.shape[-2] == s):
            continue
        if n.target in _MATMUL and val.shape[-1] == s:
            return n
        queue.extend(a for a in n.all_input_nodes if a in dep)
    return None


def _find_region(softmax: fx.Node, cp: int, s: int, dep: set, square: bool = True) -> _Attention | None:
    """The hand-written attention around `softmax`: score matmul .. softmax .. value matmul.
    ``square=False``: a softmax over [.., s, s + k] (extra logits, e.g. sinks); None if no score
    matmul leads to it (not attention)."""
    what = f"the softmax {_where(softmax)} over [.., {s}, {softmax.meta['val'].shape[-1]}] attention scores"
    nd = softmax.meta["val"].dim()
    dim = softmax.args[1] if len(softmax.args) > 1 else -1
    matmuls, seen, blocked = _score_search(softmax, s, dep)
    if not matmuls and not square:
        hidden = _hidden_scores(blocked, s, dep) if blocked is not None else None
        if hidden is None:
            return None  # not attention (no [.., s, s] score matmul nearby)
        raise _error(blocked, f"attention found at {_where(hidden)} (q @ k^T {hidden.name}, softmax {softmax.name}), "
                              f"cannot rewrite because between the scores and the softmax there is {blocked.name} "
                              f"({_op_name(blocked)}), which is not element-wise (context parallelism reruns "
                              "element-wise ops, reductions over the keys and concatenated extra logits on the "
                              "whole-sequence scores). Use cp=1")
    if dim % nd != nd - 1:
        raise _error(softmax, f"{what} normalizes over dim {dim}, not the keys (the last dim)")
    if nd != 4:
        raise _error(softmax, f"{what} is over {nd}-d scores; context parallelism rewrites "
                              "attention over [batch, heads, seq, seq] scores (4-d matmuls or SDPA), not a bmm over "
                              "merged batch and heads. Keep the head dim (q @ k.transpose(-2, -1)) or use "
                              "F.scaled_dot_product_attention, or cp=1")
    if not matmuls:
        if blocked is None:
            raise _error(softmax, f"{what}: no score matmul q @ k^T leads to it. Use cp=1")
        raise _error(blocked, f"{what}: between it and the score matmul q @ k^T there is {blocked.name} "
                              f"({_op_name(blocked)}), which is not element-wise; context parallelism reruns only "
                              "element-wise ops (scale, soft-cap, mask, casts, sink logits) on the whole-sequence "
                              "scores. Use cp=1")
    scores = matmuls[0]
    where = f"attention found at {_where(scores)} (q @ k^T {scores.name}, softmax {softmax.name})"

    def refuse(node: fx.Node, why: str) -> ValueError:
        return _error(node, f"{where}, cannot rewrite because {why}")

    if len(matmuls) > 1:
        raise refuse(softmax, f"its scores combine {len(matmuls)} matmuls ({', '.join(m.name for m in matmuls)})")
    region, cur = [scores], scores.next
    members = {scores}
    while cur is not softmax:
        if cur in seen and _region_op(cur) and any(a in members for a in cur.all_input_nodes):
            region.append(cur)
            members.add(cur)
        cur = cur.next
    if softmax.args[0] not in members:
        raise refuse(softmax, f"the softmax input {softmax.args[0].name} is not computed from the scores")
    masks, sides, width, offset = [], [], s, 0
    for node in region:
        users = [u for u in node.users if u.target is not _ASSERT and u not in members and u is not softmax]
        if users:
            raise refuse(node, f"the scores {node.name} are also used by {', '.join(u.name for u in users)}; context "
                               "parallelism needs the region between the matmuls to be used by the attention only, "
                               "through element-wise ops, reductions over the keys and concatenated extra logits")
        if node is scores:
            continue
        if any(isinstance(a, fx.Node) for a in node.kwargs.values()):
            raise refuse(node, f"{node.name} takes a tensor keyword argument")
        val = node.meta["val"]
        t = node.target
        if t is operator.getitem:
            if node.args[1] != 0:
                raise refuse(node, f"{node.name} uses output {node.args[1]} of {node.args[0].name}")
            continue
        if t in _ROW_REDUCE:
            d = _arg(node, "dim")
            d = list(d) if isinstance(d, (list, tuple)) else [d]
            if [x % 4 for x in d] != [3] or not _arg(node, "keepdim"):
                raise refuse(node, f"{node.name} ({_op_name(node)}) reduces over dims {d} (keepdim="
                                   f"{_arg(node, 'keepdim')}); a region may reduce only over the keys, keeping the dim")
            continue
        if t is aten.cat.default:
            pieces = node.args[0]
            if (node.args[1] if len(node.args) > 1 else 0) % 4 != 3:
                raise refuse(node, f"{node.name} concatenates along dim {node.args[1] if len(node.args) > 1 else 0}, "
                                   "not the keys (the last dim)")
            inside = [j for j, p in enumerate(pieces) if p in members]
            if len(inside) != 1 or width != s:
                raise refuse(node, f"{node.name} concatenates {len(inside)} pieces of the scores, or the scores are "
                                   "concatenated twice; a region may add extra logits (sinks) once")
            offset = sum(p.meta["val"].shape[-1] for p in pieces[:inside[0]])
            width = val.shape[-1]
            for j, p in enumerate(pieces):
                if j == inside[0]:
                    continue
                shape, want = tuple(p.meta["val"].shape), tuple(val.shape[:3])
                if shape[:3] != want:
                    raise refuse(node, f"{node.name} concatenates {p.name} of shape {shape} to the scores; extra "
                                       f"logits must be [batch, heads, queries, k] = [{', '.join(map(str, want))}, k]")
                (sides if p in dep else masks).append((node, (0, j)))
            continue
        for i, a in enumerate(node.args):
            if not isinstance(a, fx.Node) or a in members or not isinstance(a.meta.get("val"), torch.Tensor):
                continue
            if a in dep:
                raise refuse(node, f"{node.name} ({_op_name(node)}) combines the scores with {a.name}, which depends "
                                   "on a parameter (a learned bias); context parallelism rebuilds masks from "
                                   "positions, buffers and model inputs only (per-head extra logits may be "
                                   "concatenated along the keys, as sinks are). Use cp=1")
            masks.append((node, i))
    region.append(softmax)
    cur, slices = softmax, []
    while True:
        users = [u for u in cur.users if u.target is not _ASSERT]
        if len(users) != 1:
            raise refuse(cur, f"the attention probabilities {cur.name} are used by "
                              f"{', '.join(u.name for u in users) or 'nothing'}; context parallelism needs them to "
                              "feed one p @ v matmul (returning attention weights is not supported)")
        (user,) = users
        if user.target in _MATMUL:
            if user.args[0] is not cur:
                raise refuse(user, f"the probabilities are the right operand of {user.name}")
            pv = user
            break
        if user.target is aten.slice.Tensor and width != s:  # drop the extra logits' columns
            d = _arg(user, "dim") % 4
            if d != 3 or _slice_start(user) != offset or user.meta["val"].shape[-1] != s or _arg(user, "step") != 1:
                raise refuse(user, f"{user.name} slices the probabilities other than to the score columns "
                                   f"{offset}..{offset + s}")
            slices.append((user, offset))
            width = s
        elif not (_elementwise(user.target) or user.target in _DROPOUT or (
                user.target is operator.getitem and cur.target is aten.native_dropout.default and user.args[1] == 0)):
            raise refuse(user, f"after the softmax comes {user.name} ({_op_name(user)}), not element-wise and not "
                               "the p @ v matmul")
        if any(isinstance(a, fx.Node) and a is not cur and a in dep for a in user.args):
            raise refuse(user, f"{user.name} combines the probabilities with another activation")
        for i, a in enumerate(user.args):
            if isinstance(a, fx.Node) and a is not cur and isinstance(a.meta.get("val"), torch.Tensor):
                masks.append((user, i))
        region.append(user)
        cur = user
    if width != s:
        raise refuse(pv, f"the probabilities reach {pv.name} with the {width - s} extra columns still in")
    region.append(pv)
    q, kt, v = scores.args[0], scores.args[1], pv.args[1]
    for x in (q, kt, v):
        if not isinstance(x, fx.Node):
            raise refuse(scores, "a matmul operand is not a tensor")
    qv, kv_, vv = q.meta["val"], kt.meta["val"], v.meta["val"]
    _check_qkv(scores, f"{where}, cannot rewrite because it", qv, kv_, vv, cp, s, k_transposed=True)
    if not (qv.shape[1] == kv_.shape[1] == vv.shape[1]):
        raise refuse(scores, f"it broadcasts {kv_.shape[1]}/{vv.shape[1]} key/value heads over {qv.shape[1]} "
                             "query heads; repeat the k/v heads before the matmul, or use cp=1")
    if qv.shape[0] != kv_.shape[0] or qv.shape[0] != vv.shape[0]:
        raise refuse(scores, "it broadcasts over the batch dim")
    for node, loc in sides:
        heads = _get_loc(node, loc).meta["val"].shape[1]
        if heads != qv.shape[1]:
            raise refuse(node, f"the extra logits {_get_loc(node, loc).name} have {heads} heads against "
                               f"{qv.shape[1]} query heads")
    return _Attention("region", pv, q, kt, v, int(qv.shape[1]), masks, region, sides, slices)


def _get_loc(node: fx.Node, loc):
    """The argument of `node` at `loc`: an index into args, or (index, j) into a list argument."""
    return node.args[loc[0]][loc[1]] if isinstance(loc, tuple) else node.args[loc]


def _set_loc(node: fx.Node, loc, value) -> None:
    args = list(node.args)
    if isinstance(loc, tuple):
        inner = list(args[loc[0]])
        inner[loc[1]] = value
        args[loc[0]] = inner
    else:
        args[loc] = value
    node.args = tuple(args)


class _MaskRoles:
    """Follows each dim of a mask back to what indexes it: which positions are queries (_Q), keys
    (_KV), or indices into a sequence (_ABS). ``mask(out)`` checks every op, records
    ``memo[(node, roles)] = uses``; the rewrite replays the same rules (``inputs_of``)."""

    def __init__(self, captured: CapturedGraph, s: int, full: int, dep: set):
        self.captured, self.s, self.full, self.dep = captured, s, full, dep
        self.inputs = set(captured.inputs)
        self.state = set(captured.buffers) | set(captured.constants)
        self.memo: dict = {}
        self.nodes: set = set()        # every mask node reached
        self.inputs_read: set = set()  # model inputs masks read

    def mask(self, out: fx.Node) -> _Mask:
        val = out.meta["val"]
        roles = _root_roles(val, self.s)
        uses = self.roles(out, roles)
        return _Mask(out, roles, uses, val.dtype == torch.bool and _causal(out, roles, self.s))

    def roles(self, node: fx.Node, r) -> frozenset:
        key = (node, r)
        if key not in self.memo:
            self.nodes.add(node)
            self.memo[key] = self._roles(node, r)
        return self.memo[key]

    def _roles(self, node: fx.Node, r) -> frozenset:
        if node in self.dep:
            raise _error(node, f"the attention mask depends on a parameter through {node.name}; context parallelism "
                               "rebuilds masks from positions, buffers and inputs only. Use cp=1")
        val = node.meta.get("val")
        if node.op == "placeholder":
            return self._placeholder(node, r)
        if node.op != "call_function" or not isinstance(val, torch.Tensor):
            raise _error(node, f"the attention mask is computed by {node.name} ({node.op}), which the mask rebuild "
                               "does not follow. Use cp=1")
        t = node.target
        if t in _ARANGE:
            return self._arange(node, r)
        if t is aten.slice.Tensor and r is not None and _table_slice(node, self.state, self.s):
            d = _arg(node, "dim") % val.dim()
            if r[d] is None:
                raise _error(node, f"the table slice {node.name} of {self.s} positions lands on a mask dim that is "
                                   "neither the queries nor the keys")
            src_len = node.args[0].meta["val"].shape[d]
            start = _slice_start(node)
            if start + self.full > src_len:
                raise _error(node, f"the mask reads positions {start}..{start + self.s} of a table of length "
                                   f"{src_len} ({node.name}); the whole sequence needs {start}..{start + self.full}. "
                                   f"Make the table at least {start + self.full} long or use cp=1")
            return frozenset({r[d]}) | self.roles(node.args[0], r[:d] + (None,) + r[d + 1:])
        uses = set()
        for x, rx in _inputs_of(node, r, self.s):
            uses |= self.roles(x, rx)
        return frozenset(uses)

    def _placeholder(self, node: fx.Node, r) -> frozenset:
        if r is None:
            return frozenset()
        if node.name in self.inputs:
            bad = [d for d, x in enumerate(r) if x in (_Q, _KV) and d != 1]
            if bad or len(r) < 2:
                raise _error(node, f"the mask reads model input {node.name} with its dim {bad[0] if bad else 0} on "
                                   "the query/key dims; context parallelism shards inputs along dim 1")
            if r[1] is None:
                raise _error(node, f"the mask uses the sequence dim of model input {node.name} other than by position "
                                   "(a reduction or a head/batch dim?); the rebuild cannot follow it. Use cp=1")
            self.inputs_read.add(node)
            return frozenset({r[1]})
        if node.name in self.state:
            bad = [d for d, x in enumerate(r) if x in (_Q, _KV)]
            if bad:
                n = node.meta["val"].shape[bad[0]]
                raise _error(node, f"the mask reads {node.name} whole along dim {bad[0]} ({n} long) as "
                                   f"{'query' if r[bad[0]] == _Q else 'key'} positions; the whole sequence needs "
                                   f"{self.full}. Slice it by the sequence length from a longer table, or use cp=1")
            return frozenset()
        raise _error(node, f"the attention mask depends on {node.name}, which is not a model input or buffer")

    def _arange(self, node: fx.Node, r) -> frozenset:
        role = r[0] if r else None
        if role is None:
            return frozenset()
        start = _arg(node, "start") if _has_arg(node, "start") else 0
        step = _arg(node, "step") if _has_arg(node, "step") else 1
        if role == _ABS:  # the mask reads a tensor of positions (position_ids, cache_position) by position
            if node.meta["val"].numel() != self.s:
                return frozenset()  # not along the sequence (the batch arange of index(x, [b_idx, q_idx]))
            if step != 1 or start != int(start):
                raise _error(node, f"the mask reads the values of {node.name} = arange({start}, step={step}) of "
                                   f"{self.s} values by position; the rebuild extends consecutive integer positions "
                                   "to the whole sequence only. Use cp=1")
            return frozenset({_ABS})
        if step != 1 or node.meta["val"].numel() != self.s or start != int(start):
            raise _error(node, f"{node.name} gives the mask's {'query' if role == _Q else 'key'} positions but is "
                               f"arange({start}, step={step}) of {node.meta['val'].numel()} values, not {self.s} "
                               "consecutive integers. Use cp=1")
        return frozenset({role})


def _inputs_of(node: fx.Node, r, s: int | None = None) -> list:
    """[(input node, its roles)] of a mask op whose output dims have roles `r` (None: only the
    dtype/device of the value matters). Raises for ops the rebuild does not follow. ``s``: the
    shard length (a dim of that length read whole, by a reduction, cumsum or a fixed window, is
    the sequence: its input is taken over the whole sequence, role _ABS)."""
    t, val = node.target, node.meta["val"]
    tensors = [a for a in node.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)]
    if r is None:
        return [(a, None) for a in tensors]
    if t in _FACTORY:
        return []
    if t in _SHAPE_ONLY:
        return [(node.args[0], None)]
    if t in _LIKE:  # the value ignores the input, but the shape follows it
        return [(node.args[0], r)]
    if t is aten.slice.Tensor:
        x = node.args[0]
        d = _arg(node, "dim") % val.dim()
        start, end, n = _arg(node, "start"), _arg(node, "end"), x.meta["val"].shape[d]
        if _slice_start(node) == 0 and (end is None or end >= n) and _arg(node, "step") == 1:
            return [(x, r)]
        if r[d] is None and n == s and (start or 0) >= 0 and end is not None and 0 <= end < n:
            # a fixed window at the start of the sequence (position_ids[:, :1]): the same window of the whole
            return [(x, r[:d] + (_ABS,) + r[d + 1:])]
        raise _error(node, f"the mask slices {node.name} along dim {d} ({_op_name(node)}); the rebuild follows "
                           "no-op slices, windows at the start of the sequence and slices of buffers by the "
                           "sequence length only. Use cp=1")
    if t in (aten.cumsum.default, aten.diff.default):  # along one dim: the whole sequence or not the sequence
        d = _arg(node, "dim") % val.dim()
        if r[d] != _ABS and (r[d] is not None or val.shape[d] == s):
            raise _error(node, f"the attention mask is computed with {node.name} ({_op_name(node)}) along its "
                               f"{'query' if r[d] == _Q else 'key' if r[d] == _KV else 'sequence'} positions; the "
                               "rebuild computes masks block by block and follows such scans only over a sequence "
                               "tensor read by position (position_ids[b_idx, q_idx]). Use cp=1")
        out = [(node.args[0], r)]
        for name in ("prepend", "append"):
            if t is aten.diff.default and isinstance(_arg(node, name), fx.Node):
                out.append((_arg(node, name), r[:d] + (None,) + r[d + 1:]))
        return out
    if t in _REDUCE:  # over a dim read whole: over the whole sequence when it is the sequence
        x = node.args[0]
        xs = x.meta["val"].shape
        dims = _arg(node, "dim") if _has_arg(node, "dim") else None
        dims = range(len(xs)) if dims is None or dims == [] else [dims] if isinstance(dims, int) else dims
        gone = {d % len(xs) for d in dims}
        keep = bool(_arg(node, "keepdim")) if _has_arg(node, "keepdim") else False
        it = iter(r)
        rx = []
        for d in range(len(xs)):
            if d in gone:
                if keep:
                    next(it)
                rx.append(_ABS if xs[d] == s else None)
            else:
                rx.append(next(it))
        return [(x, tuple(rx))]
    if t is aten.unsqueeze.default:
        d = node.args[1] % val.dim()
        return [(node.args[0], r[:d] + r[d + 1:])]
    if t in (aten.squeeze.dim, aten.squeeze.dims):
        x = node.args[0]
        dims = node.args[1] if isinstance(node.args[1], (list, tuple)) else [node.args[1]]
        xd = x.meta["val"].dim()
        gone = {d % xd for d in dims if x.meta["val"].shape[d % xd] == 1}
        it = iter(r)
        return [(x, tuple(None if d in gone else next(it) for d in range(xd)))]
    if t in _VIEWS or t is aten.expand.default:
        x = node.args[0]
        xs = tuple(x.meta["val"].shape)
        if t is aten.expand.default:
            n = len(xs)
            return [(x, tuple(None if xs[i] == 1 else r[len(r) - n + i] for i in range(n)))]
        keep_in = [i for i, n in enumerate(xs) if n != 1]
        keep_out = [i for i, n in enumerate(val.shape) if n != 1]
        if [xs[i] for i in keep_in] != [val.shape[i] for i in keep_out]:
            raise _error(node, f"the mask is reshaped by {node.name} from {xs} to {tuple(val.shape)}; the rebuild "
                               "follows views that add or drop size-1 dims only. Use cp=1")
        rx = [None] * len(xs)
        for i, o in zip(keep_in, keep_out):
            rx[i] = r[o]
        return [(x, tuple(rx))]
    if t is aten.permute.default:
        dims = [d % val.dim() for d in node.args[1]]
        rx = [None] * len(dims)
        for o, i in enumerate(dims):
            rx[i] = r[o]
        return [(node.args[0], tuple(rx))]
    if t is aten.transpose.int:
        d0, d1 = (d % val.dim() for d in node.args[1:3])
        rx = list(r)
        rx[d0], rx[d1] = rx[d1], rx[d0]
        return [(node.args[0], tuple(rx))]
    if t is aten.index.Tensor:
        x, indices = node.args[0], node.args[1]
        if any(i is None for i in indices):
            raise _error(node, f"the mask indexes with {node.name} using None (slice) indices; the rebuild follows "
                               "full advanced indexing only (mask[b_idx, kv_idx]). Use cp=1")
        nb = val.dim() - (x.meta["val"].dim() - len(indices))
        out = [(x, (_ABS,) * len(indices) + r[nb:])]
        for i in indices:
            shape = i.meta["val"].shape
            off = nb - len(shape)
            out.append((i, tuple(None if shape[j] == 1 else r[off + j] for j in range(len(shape)))))
        return out
    if t is aten.type_as.default:
        return [(node.args[0], _broadcast_roles(node.args[0], val, r)), (node.args[1], None)]
    if _elementwise(t):
        return [(a, _broadcast_roles(a, val, r)) for a in tensors]
    raise _error(node, f"the attention mask is computed with {node.name} ({_op_name(node)}), which the mask "
                       "rebuild does not follow (it follows element-wise ops, broadcasts, unsqueeze/expand, size-1 "
                       "views, permutes, index by positions, slices of buffers, and reductions/cumsum/diff over a "
                       "sequence read by position). Use cp=1")


def _root_roles(val: torch.Tensor, s: int) -> tuple:
    r = [None] * val.dim()
    if val.dim() >= 1 and val.shape[-1] == s:
        r[-1] = _KV
    if val.dim() >= 2 and val.shape[-2] == s:
        r[-2] = _Q
    return tuple(r)


def _broadcast_roles(x: fx.Node, out: torch.Tensor, r: tuple) -> tuple:
    shape = x.meta["val"].shape
    off = out.dim() - len(shape)
    return tuple(None if shape[i] == 1 and out.shape[off + i] != 1 else r[off + i] for i in range(len(shape)))


def _table_slice(node: fx.Node, state: set, s: int) -> bool:
    """A slice picking s positions out of a longer buffer/constant table."""
    x = node.args[0]
    d = _arg(node, "dim") % x.meta["val"].dim()
    if _arg(node, "step") != 1 or node.meta["val"].shape[d] != s or x.meta["val"].shape[d] == s:
        return False
    while x.op == "call_function" and x.target in _TABLE_CHAIN:
        x = x.args[0]
    return x.op == "placeholder" and x.name in state


def _slice_start(node: fx.Node) -> int:
    start = _arg(node, "start")
    start = 0 if start is None else start
    if start < 0:
        start += node.args[0].meta["val"].shape[_arg(node, "dim") % node.meta["val"].dim()]
    return start


def _causal(out: fx.Node, roles: tuple, s: int) -> bool:
    """True if `out` is statically the causal mask: kv_position - q_position <= 0 everywhere."""
    def ev(node, r):
        if not isinstance(node, fx.Node):
            return ("const", node) if isinstance(node, (int, float, bool)) else None
        t = node.target
        if node.op != "call_function":
            return None
        if t in _ARANGE:
            role = r[0] if r else None
            start = _arg(node, "start") if _has_arg(node, "start") else 0
            return ("idx", role, start) if role in (_Q, _KV) else None
        if t in (aten.new_ones.default, aten.ones.default) and _kw_dtype(node) == torch.bool:
            return ("true",)
        if t in (aten.add.Tensor, aten.sub.Tensor) and not isinstance(node.args[1], fx.Node) and (
                len(node.args) < 3 and node.kwargs.get("alpha", 1) == 1):
            x = ev(node.args[0], _in_roles(node, r, 0, s))
            c = node.args[1] if t is aten.add.Tensor else -node.args[1]
            return ("idx", x[1], x[2] + c) if x and x[0] == "idx" else None
        if t in (aten.unsqueeze.default, aten.expand.default, aten.clone.default, aten.alias.default,
                 aten.detach.default) or t in _VIEWS:
            return ev(node.args[0], _in_roles(node, r, 0, s))
        if t is aten._to_copy.default and _kw_dtype(node) in (None, torch.bool, torch.int64, torch.int32):
            return ev(node.args[0], _in_roles(node, r, 0, s))
        if t in (aten.le.Tensor, aten.lt.Tensor, aten.ge.Tensor, aten.gt.Tensor):
            a, b = (ev(node.args[i], _in_roles(node, r, i, s)) for i in (0, 1))
            if not (a and b and a[0] == b[0] == "idx"):
                return None
            if t in (aten.ge.Tensor, aten.gt.Tensor):
                a, b = b, a  # a <= b or a < b
            strict = t in (aten.lt.Tensor, aten.gt.Tensor)
            if a[1] == _KV and b[1] == _Q:  # K + ca <= Q + cb: K - Q <= cb - ca
                return ("pred", -math.inf, b[2] - a[2] - (1 if strict else 0))
            if a[1] == _Q and b[1] == _KV:  # Q + ca <= K + cb: K - Q >= ca - cb
                return ("pred", a[2] - b[2] + (1 if strict else 0), math.inf)
            return None
        if t in (aten.__and__.Tensor, aten.logical_and.default, aten.bitwise_and.Tensor):
            a, b = (ev(node.args[i], _in_roles(node, r, i, s)) for i in (0, 1))
            if a == ("true",):
                return b
            if b == ("true",):
                return a
            if a and b and a[0] == b[0] == "pred":
                return ("pred", max(a[1], b[1]), min(a[2], b[2]))
            return None
        return None

    try:
        v = ev(out, roles)
    except (ValueError, KeyError, IndexError, TypeError):
        return False
    return v == ("pred", -math.inf, 0)


def _in_roles(node: fx.Node, r, i: int, s: int):
    x = node.args[i]
    for a, ra in _inputs_of(node, r, s):
        if a is x:
            return ra
    return None


def _kw_dtype(node: fx.Node):
    return node.kwargs.get("dtype")


def _find_positions(captured: CapturedGraph, cp: int, s: int, full: int, skip: set = frozenset()):
    """(arange node, start) and (slice node, start, table name) that pick the local positions
    outside the masks (`skip`: mask nodes, which the rebuild replaces)."""
    graph = captured.gm.graph
    state = set(captured.buffers) | set(captured.constants)
    aranges, slices = [], []
    for node in graph.nodes:
        if node.op != "call_function" or node in skip:
            continue
        val = node.meta.get("val")
        if node.target in _ARANGE:
            start = _arg(node, "start") if _has_arg(node, "start") else 0
            step = _arg(node, "step") if _has_arg(node, "step") else 1
            if step == 1 and val.numel() == s and val.dim() == 1:
                if start != int(start):
                    raise _error(node, f"{_where(node)} is arange({start}, ...) with {s} values, the sequence shard "
                                       "length; context parallelism can only offset integer starts. Pass the positions "
                                       "as a model input (sharded with the data) or use cp=1")
                aranges.append((node, int(start)))
        elif node.target is aten.slice.Tensor:
            dim = _arg(node, "dim")
            src = node.args[0]
            src_val = src.meta["val"]
            dim = dim % src_val.dim()
            step = _arg(node, "step")
            if step != 1 or val.shape[dim] != s or src_val.shape[dim] == s:
                continue
            table, other_dims = _table_of(src, state, s)
            if table is None:
                continue
            if other_dims:
                raise _error(node, f"{table.name} is sliced to the sequence shard length {s} along two dims "
                                   f"({_where(node)}) and used outside an attention mask: each rank would see its "
                                   "diagonal block only. Use it as an attention mask, or cp=1")
            start = _slice_start(node)
            if start + full > src_val.shape[dim]:
                raise _error(node, f"{_where(node)} takes positions {start}..{start + s} of {table.name} "
                                   f"(length {src_val.shape[dim]} along dim {dim}); with cp={cp} the full sequence "
                                   f"needs {start}..{start + full}. Make the table at least {start + full} long "
                                   f"(max sequence length >= {full}) or use cp=1")
            slices.append((node, start, table.name))
    return aranges, slices


def _table_of(node: fx.Node, state: set[str], s: int):
    """(buffer/constant placeholder a slice reads, whether a slice to length s is already on the way)."""
    seen_positional = False
    while node.op == "call_function" and node.target in _TABLE_CHAIN:
        if node.target is aten.slice.Tensor:
            src_val = node.args[0].meta["val"]
            dim = _arg(node, "dim") % src_val.dim()
            if node.meta["val"].shape[dim] == s and src_val.shape[dim] != s:
                seen_positional = True
        node = node.args[0]
    if node.op == "placeholder" and node.name in state:
        return node, seen_positional
    return None, False
