"""Statically causal attention masks become SDPA's ``is_causal``.

Hugging Face models (and others) build their causal mask in the graph: query and key positions
(aranges, often looked up through ``index`` from a ``position_ids``-like arange) compared
``kv <= q``, and-ed with an all-true padding mask and with a same-document test (the packed
sequence detection: ``cumsum(diff(positions) != 1)``, all one document when the positions are
an arange), expanded to ``[B, 1, S, S]`` and handed to ``scaled_dot_product_attention`` as a
boolean ``attn_mask``. Traced, that mask is a ``[B, 1, S, S]`` tensor every layer reads: the
pipeline sends it across every stage boundary (at S = 8192, 64 MiB per microbatch and
boundary), and attention with an explicit mask computes every score block, where a causal
kernel skips the masked half.

``make_causal`` proves a mask causal by evaluating its computation abstractly (``_Eval``): a
value is an integer affine function of the output coordinates (``aff``: a constant plus a
coefficient per dimension, dimensions counted from the right so that broadcasting lines them
up), a boolean constant, or a predicate ``lo <= coord[kv] - coord[q] <= hi`` (``pred``).
aranges, views that add or broadcast dimensions, slices, advanced indexing by affine indices,
scalar arithmetic, ``diff`` / ``cumsum`` of affine values, comparisons and ``and`` follow exact
rules; anything else (an input, a parameter, a buffer, an op without a rule) is unknown, and the
mask stays. A boolean ``attn_mask`` whose value is ``coord[-1] - coord[-2] <= 0`` over square
``[.., S, S]`` scores is dropped and SDPA runs with ``is_causal=True`` (SDPA's causal mask is
exactly that when queries and keys have the same length); the mask's computation is erased
where nothing else reads it. A padding mask from the inputs, a sliding window, documents read
from the data: left as they are.
"""
from __future__ import annotations

import math

import torch
import torch.fx as fx

from .cp_rules import _ARANGE, _arg, _set_arg

aten = torch.ops.aten
_SDPA = (aten.scaled_dot_product_attention.default,)
_SAME = (aten.expand.default, aten.clone.default, aten.alias.default, aten.detach.default,
         aten.lift_fresh_copy.default, aten.contiguous.default)
_CMP = {aten.le.Tensor: "le", aten.lt.Tensor: "lt", aten.ge.Tensor: "ge", aten.gt.Tensor: "gt",
        aten.le.Scalar: "le", aten.lt.Scalar: "lt", aten.ge.Scalar: "ge", aten.gt.Scalar: "gt",
        aten.eq.Tensor: "eq", aten.eq.Scalar: "eq", aten.ne.Tensor: "ne", aten.ne.Scalar: "ne"}
_METADATA_CHECKS = (aten._assert_tensor_metadata.default,)
_AND = (aten.__and__.Tensor, aten.logical_and.default, aten.bitwise_and.Tensor, aten.mul.Tensor)


def make_causal(gm: fx.GraphModule) -> int:
    """Rewrite ``gm`` in place (module docstring); returns how many attentions became causal."""
    ev = _Eval()
    changed, dropped = 0, []
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in _SDPA or _arg(node, "is_causal"):
            continue
        mask = _arg(node, "attn_mask")
        if not isinstance(mask, fx.Node):
            continue
        val, q, k = mask.meta.get("val"), node.args[0].meta.get("val"), node.args[1].meta.get("val")
        if val is None or q is None or k is None or val.dtype != torch.bool or val.dim() < 2:
            continue
        s = q.shape[-2]
        if k.shape[-2] != s or tuple(val.shape[-2:]) != (s, s) or s < 2:
            continue
        v = ev(mask)
        if not (v and v[0] == "pred" and v[3:] == (-1, -2) and v[1] <= -(s - 1) and v[2] == 0):
            continue
        _set_arg(node, "attn_mask", None)
        _set_arg(node, "is_causal", True)
        dropped.append(mask)
        changed += 1
    _erase_unused(gm.graph, dropped)
    if changed:
        gm.graph.lint()
        gm.recompile()
    return changed


def _shape(x) -> tuple:
    if isinstance(x, fx.Node):
        val = x.meta.get("val")
        return tuple(val.shape) if isinstance(val, torch.Tensor) else ()
    return ()


def _aff(c, co: dict, shape: tuple):
    """An affine value, its coefficients on size-1 dimensions dropped (their coordinate is 0)."""
    r = len(shape)
    return ("aff", c, {d: a for d, a in co.items() if a and -r <= d < 0 and shape[r + d] != 1})


class _Eval:
    """The abstract value of a node (module docstring); None when unknown. Memoized."""

    def __init__(self):
        self.memo: dict = {}

    def __call__(self, x):
        if not isinstance(x, fx.Node):
            if isinstance(x, bool):
                return ("bool", x)
            if isinstance(x, int):
                return ("aff", x, {})
            return None
        if x not in self.memo:
            try:
                self.memo[x] = self._eval(x)
            except (ValueError, KeyError, IndexError, TypeError, ZeroDivisionError):
                self.memo[x] = None
        return self.memo[x]

    def _eval(self, n: fx.Node):
        if n.op != "call_function":
            return None
        t, shape = n.target, _shape(n)
        val = n.meta.get("val")
        is_bool = isinstance(val, torch.Tensor) and val.dtype == torch.bool
        if t in _ARANGE:
            a = [x for x in n.args]
            start, end, step = (0, a[0], 1) if len(a) == 1 else (a[0], a[1], a[2] if len(a) > 2 else 1)
            if not all(isinstance(v, int) for v in (start, end, step)):
                return None
            return _aff(start, {-1: step}, shape)
        if t in (aten.new_ones.default, aten.ones.default, aten.new_zeros.default, aten.zeros.default,
                 aten.full.default, aten.new_full.default):
            fill = 1 if t in (aten.new_ones.default, aten.ones.default) else 0 if t in (
                aten.new_zeros.default, aten.zeros.default) else n.args[-1]
            if not isinstance(fill, (int, bool)):
                return None
            return ("bool", bool(fill)) if is_bool else _aff(int(fill), {}, shape)
        if t in _SAME:
            return self._reshaped(self(n.args[0]), shape)
        if t is aten._to_copy.default:
            x = self(n.args[0])
            if x is None:
                return None
            if is_bool:
                return x if x[0] != "aff" else (("bool", bool(x[1])) if not x[2] else None)
            return ("aff", int(x[1]), x[2]) if x[0] == "bool" else x
        if t is aten.unsqueeze.default:
            return self._unsqueeze(n, self(n.args[0]))
        if t is aten.slice.Tensor:
            return self._slice(n, self(n.args[0]))
        if t is aten.index.Tensor:
            return self._index(n)
        if t in (aten.add.Tensor, aten.sub.Tensor, aten.add.Scalar, aten.sub.Scalar):
            a, b = self(n.args[0]), self(n.args[1])
            alpha = n.kwargs.get("alpha", n.args[2] if len(n.args) > 2 else 1)
            if not (a and b and a[0] == b[0] == "aff" and isinstance(alpha, int)):
                return None
            sign = alpha if t in (aten.add.Tensor, aten.add.Scalar) else -alpha
            co = dict(a[2])
            for d, c in b[2].items():
                co[d] = co.get(d, 0) + sign * c
            return _aff(a[1] + sign * b[1], co, shape)
        if t in _CMP:
            return self._compare(n, _CMP[t], shape)
        if t in _AND:
            a, b = self(n.args[0]), self(n.args[1])
            if not (a and b) or (t is aten.mul.Tensor and not is_bool):
                return None
            if a == ("bool", True):
                return self._reshaped(b, shape)
            if b == ("bool", True):
                return self._reshaped(a, shape)
            if a == ("bool", False) or b == ("bool", False):
                return ("bool", False)
            if a[0] == b[0] == "pred" and a[3:] == b[3:]:
                return ("pred", max(a[1], b[1]), min(a[2], b[2])) + a[3:]
            return None
        if t is aten.diff.default:
            return self._diff(n, shape)
        if t is aten.cumsum.default:
            x = self(n.args[0])
            if x is None or x[0] == "pred":
                return None
            k = int(x[1]) if x[0] == "bool" else x[1]
            if x[0] == "aff" and x[2]:
                return None  # the running sum of a varying value is not affine
            d = n.args[1] - len(shape) if n.args[1] >= 0 else n.args[1]
            return _aff(k, {d: k}, shape)  # k, 2k, 3k, ...: k * (coordinate + 1)
        return None

    @staticmethod
    def _reshaped(x, shape):
        if x is None or x[0] != "aff":
            return x
        return _aff(x[1], x[2], shape)

    def _unsqueeze(self, n, x):
        if x is None:
            return None
        r = len(_shape(n.args[0]))
        d = n.args[1] % (r + 1)

        def move(ri):  # a dimension left of the new one moves one further from the right
            return ri - 1 if ri + r < d else ri
        if x[0] == "aff":
            return _aff(x[1], {move(ri): c for ri, c in x[2].items()}, _shape(n))
        if x[0] == "pred":
            return x[:3] + (move(x[3]), move(x[4]))
        return x

    def _slice(self, n, x):
        if x is None or x[0] != "aff":
            return x if x is not None and x[0] == "bool" else None
        src = _shape(n.args[0])
        dim = (n.args[1] if len(n.args) > 1 else 0) % len(src)
        start = n.args[2] if len(n.args) > 2 else 0
        step = n.args[4] if len(n.args) > 4 else 1
        start = 0 if start is None else start
        if not isinstance(start, int) or not isinstance(step, int):
            return None
        start = start + src[dim] if start < 0 else start
        ri = dim - len(src)
        a = x[2].get(ri, 0)
        co = dict(x[2])
        if a:
            co[ri] = a * step
        return _aff(x[1] + a * start, co, _shape(n))

    def _index(self, n):
        x = self(n.args[0])
        indices = n.args[1]
        src = _shape(n.args[0])
        if x is None or x[0] != "aff" or any(i is None for i in indices):
            return None
        m, r = len(indices), len(src)
        vals = [self(i) for i in indices]
        if any(v is None or v[0] != "aff" for v in vals):
            return None
        shift = -(r - m)  # the broadcast index dims sit left of x's trailing (not indexed) dims
        c, co = x[1], {ri: a for ri, a in x[2].items() if ri >= m - r}
        for k, v in enumerate(vals):
            a = x[2].get(k - r, 0)
            if not a:
                continue
            c += a * v[1]
            for ri, b in v[2].items():
                co[ri + shift] = co.get(ri + shift, 0) + a * b
        return _aff(c, co, _shape(n))

    def _compare(self, n, op, shape):
        a, b = self(n.args[0]), self(n.args[1])
        if a and b and a[0] == b[0] == "bool" and op in ("eq", "ne"):
            return ("bool", (a[1] == b[1]) == (op == "eq"))
        if not (a and b and a[0] == b[0] == "aff"):
            return None
        co = dict(a[2])
        for d, c in b[2].items():
            co[d] = co.get(d, 0) - c
        co = {d: c for d, c in co.items() if c}
        c = a[1] - b[1]  # a - b = c + sum co[d] * coord[d]
        if not co:
            return ("bool", {"le": c <= 0, "lt": c < 0, "ge": c >= 0, "gt": c > 0, "eq": c == 0, "ne": c != 0}[op])
        if op in ("eq", "ne") or set(co) != {-1, -2} or co[-1] != -co[-2] or abs(co[-1]) != 1:
            return None
        if co[-1] == -1:  # a - b = c - (kv - q): flip to c' + (kv - q)
            c, op = -c, {"le": "ge", "lt": "gt", "ge": "le", "gt": "lt"}[op]
        # (kv - q) + c  op  0
        lo, hi = {"le": (-math.inf, -c), "lt": (-math.inf, -c - 1), "ge": (-c, math.inf), "gt": (-c + 1, math.inf)}[op]
        return ("pred", lo, hi, -1, -2)

    def _diff(self, n, shape):
        x = self(n.args[0])
        nn_ = n.args[1] if len(n.args) > 1 else n.kwargs.get("n", 1)
        dim = n.args[2] if len(n.args) > 2 else n.kwargs.get("dim", -1)
        prepend = n.args[3] if len(n.args) > 3 else n.kwargs.get("prepend")
        append = n.args[4] if len(n.args) > 4 else n.kwargs.get("append")
        if x is None or x[0] != "aff" or nn_ != 1 or append is not None:
            return None
        ri = (dim % len(_shape(n.args[0]))) - len(_shape(n.args[0]))
        a = x[2].get(ri, 0)
        if prepend is not None:  # the first difference is x[0] - prepend: a as well when prepend is x[0] - a
            p = self(prepend)
            rest = {d: c for d, c in x[2].items() if d != ri}
            if p is None or p[0] != "aff" or p[1] != x[1] - a or {d: c for d, c in p[2].items() if d != ri} != rest:
                return None
        return _aff(a, {}, shape)


def _erase_unused(graph: fx.Graph, nodes: list) -> None:
    """Erase ``nodes`` and, in turn, what only they read, while they are computations nothing uses
    (but export's metadata checks of them)."""
    stack, gone = list(nodes), set()
    while stack:
        n = stack.pop()
        if n in gone or n.op != "call_function":
            continue
        if n.users and all(u.target in _METADATA_CHECKS and not u.users for u in n.users):
            for u in list(n.users):  # export's checks of a value's dtype/device: nothing to check once it is gone
                graph.erase_node(u)
                gone.add(u)
        if n.users:
            continue
        inputs = n.all_input_nodes
        graph.erase_node(n)
        gone.add(n)
        stack.extend(inputs)
