"""How a value sharded over tp travels through each op of a forward graph (``_rule``): which
dim of the output is sharded given where the inputs are, or ``_NoRule`` when the op cannot keep
it sharded. The op families come from passes/op_semantics.py; passes/tensor_parallel.py
(column / row linears) and passes/sequence_parallel.py (token-sharded regions) both follow it."""
from __future__ import annotations

import math
import operator

import torch
import torch.fx as fx

from . import op_semantics
from .costs import is_random
from .provenance import module_path, op_name, source_of

aten = torch.ops.aten


class _NoRule(Exception):
    pass


_SAME = op_semantics.SAME_VALUE  # the op families: passes/op_semantics.py
_VIEWS = op_semantics.VIEWS
_SOFTMAX = op_semantics.SOFTMAX | op_semantics.LOG_SOFTMAX
_REDUCE = {aten.sum.dim_IntList, aten.mean.dim, aten.amax.default, aten.amin.default}
_SPLITS = {aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default}
_SDPA = {aten.scaled_dot_product_attention.default}
_NORMS = {aten.layer_norm.default, aten.rms_norm.default}
_MATMUL = op_semantics.MATMUL


def _val(a):
    return a.meta.get("val") if isinstance(a, fx.Node) else None


def _tensor_args(node: fx.Node) -> list[fx.Node]:
    out = []
    fx.node.map_arg((node.args, node.kwargs),
                    lambda a: out.append(a) if isinstance(_val(a), (torch.Tensor, list, tuple)) else None)
    return out


def _norm(d: int, ndim: int) -> int:
    return d + ndim if d < 0 else d


_op = op_name


def _where(node: fx.Node) -> str:
    path = module_path(node)
    src = source_of(node)
    return f"{node.name}" + (f" in {path}" if path else "") + (f" ({src})" if src else "")


def is_elementwise(node: fx.Node) -> bool:
    t = node.target
    return isinstance(t, torch._ops.OpOverload) and torch.Tag.pointwise in t.tags or t == aten.where.self


def _pointwise(node: fx.Node, dims: dict) -> tuple[int, list[tuple[fx.Node, int]]]:
    """An element-wise op with a sharded input: (the output dim every sharded input maps to,
    inputs aligned from the right as broadcasting does; (replicated input, its dim) for each
    replicated input read whole along that dim), or _NoRule when the inputs disagree."""
    out = _val(node)
    target = None
    for a in _tensor_args(node):
        if a in dims:
            d = dims[a] + out.dim() - _val(a).dim()
            if target is not None and d != target:
                raise _NoRule(f"inputs sharded along different dims ({target} and {d})")
            if _val(a).shape[dims[a]] != out.shape[d]:
                raise _NoRule("a sharded input is broadcast along its sharded dim")
            target = d
    cut = []
    for a in _tensor_args(node):
        if a not in dims:
            v = _val(a)
            i = target - (out.dim() - v.dim())
            if 0 <= i < v.dim() and v.shape[i] != 1:
                if v.shape[i] != out.shape[target]:
                    raise _NoRule(f"a replicated input ({a.name}, shape {tuple(v.shape)}) is broadcast along the "
                                  f"sharded dim {target}")
                cut.append((a, i))
    return target, cut


def replicated_reads(node: fx.Node, dims: dict) -> list[tuple[fx.Node, int]]:
    """The replicated inputs an element-wise op with a sharded input reads whole along the
    sharded dim, (input, its dim) each: cut to the rank's block, the op reads only what it needs."""
    return _pointwise(node, dims)[1]


def narrowed(node: fx.Node, dims: dict, tp: int) -> list[tuple[fx.Node, int, int]]:
    """The replicated inputs a sharded op reads along its sharded dim, each (input, dim, blocks):
    the rank reads block ``rank * blocks // tp`` of ``blocks`` equal ones along ``dim`` (a
    ``narrow``, whose backward zero-pads; a value with a gradient goes through ``tp_copy`` first,
    which sums the ranks' parts). Element-wise operands read whole along the sharded dim (blocks =
    tp), attention's keys/values when only the queries are head-sharded: GQA with fewer key/value
    heads than tp, whose key/value projections stay replicated (after a repeat to the query heads:
    blocks = tp; SDPA's ``enable_gqa``: the rank's query heads read ``Hkv / min(Hkv, tp)`` key/value
    heads, one when Hkv < tp, as Megatron replicates them)."""
    t = node.target
    if is_elementwise(node):
        return [(a, i, tp) for a, i in replicated_reads(node, dims)]
    if t in _SDPA:
        q = node.args[0]
        if dims.get(q) != 1 or _val(q).dim() != 4:
            return []
        hq, out = _val(q).shape[1], []
        for a in node.args[1:3]:
            h = _val(a).shape[1] if isinstance(a, fx.Node) and _val(a).dim() == 4 else None
            if a in dims or h is None:
                continue
            if h == hq:
                out.append((a, 1, tp))
            elif node.kwargs.get("enable_gqa") and (h % tp == 0 or tp % h == 0):
                out.append((a, 1, min(h, tp)))
        mask = _argument(node, 3, "attn_mask", None)
        if isinstance(mask, fx.Node) and mask not in dims and _val(mask).dim() >= 3 and \
                _val(mask).shape[_val(mask).dim() - 3] == hq:  # a per-head mask: the rank's heads'
            out.append((mask, _val(mask).dim() - 3, tp))
        return out
    if t == aten.cat.default:  # MLA's keys: [nope (head-sharded), rope (one head, expanded)]
        tensors, dim = node.args[0], _norm(_argument(node, 1, "dim", 0), _val(node).dim())
        ds = {dims[a] for a in tensors if a in dims}
        if len(ds) != 1 or dim in ds:
            return []
        d = ds.pop()
        return [(a, d, tp) for a in tensors if a not in dims and _val(a).dim() == _val(node).dim()
                and _val(a).shape[d] == _val(node).shape[d]]
    if t in _MATMUL:
        a, b = node.args[:2]
        if (a in dims) == (b in dims) or _val(a).dim() != _val(b).dim():
            return []
        x, y = (a, b) if a in dims else (b, a)
        d = dims[x]
        return [(y, d, tp)] if d < _val(x).dim() - 2 and _val(y).shape[d] == _val(x).shape[d] else []
    return []


def _view_dim(src: torch.Size, dst: torch.Size, d: int, tp: int) -> int:
    """Where dim d of ``src`` lands in the view ``dst``: the dst dim whose leading elements start
    where it starts (same product of the dims before) and that tp divides; rank r's contiguous
    block then stays one block (the sizes after it multiply to the same count)."""
    before = math.prod(src[:d])
    acc = 1
    for e, n in enumerate(dst):
        if acc == before and n % tp == 0 and n >= tp:
            return e
        acc *= n
        if acc > before:
            break
    raise _NoRule(f"a view from {tuple(src)} to {tuple(dst)} splits the sharded dim {d} (size {src[d]}) into "
                  f"pieces tp={tp} does not divide")


def _dims_arg(node: fx.Node, i: int, ndim: int) -> list[int]:
    a = node.args[i] if len(node.args) > i else node.kwargs.get("dim")
    if a is None:
        return list(range(ndim))
    return [_norm(x, ndim) for x in (a if isinstance(a, (list, tuple)) else [a])]


def _rule(node: fx.Node, dims: dict, tp: int):
    """The output placement of a node with a sharded input (an int dim; a tuple for tuple
    results; None: replicated, no output), or _NoRule."""
    t = node.target
    x = node.args[0] if node.args else None
    xd = dims.get(x)
    out = _val(node)
    if t is operator.getitem:
        return xd[node.args[1]] if isinstance(xd, tuple) else _no(xd)
    if is_random(node):  # (SDPA with dropout_p > 0 too)
        raise _NoRule("random numbers in a sharded region differ from one process's")
    if t == aten._assert_tensor_metadata.default:
        return None
    if t in _SAME:
        return xd
    if t == aten.type_as.default:  # x's values in the other's dtype
        return _no(None) if xd is None else xd
    if t in (aten.view_as_complex.default, aten.view_as_real.default):  # RoPE by complex products
        if t == aten.view_as_complex.default and xd == _val(x).dim() - 1:
            raise _NoRule("view_as_complex of the sharded (real, imaginary) dim")
        return xd
    if is_elementwise(node):
        d, cut = _pointwise(node, dims)
        if cut:  # (narrowed() cuts them first; a caller that does not, keeps the region replicated)
            raise _NoRule(f"a replicated input ({cut[0][0].name}) is read along the sharded dim {d}")
        return d
    if t in _VIEWS:
        return _view_dim(_val(x).shape, out.shape, xd, tp)
    if t == aten.expand.default:
        d = xd + out.dim() - _val(x).dim()
        if out.shape[d] != _val(x).shape[xd]:
            raise _NoRule("expand along the sharded dim")
        return d
    if t == aten.transpose.int:
        a, b = (_norm(i, out.dim()) for i in node.args[1:3])
        return b if xd == a else a if xd == b else xd
    if t == aten.t.default:
        return 1 - xd
    if t == aten.permute.default:
        return [_norm(i, out.dim()) for i in node.args[1]].index(xd)
    if t == aten.unsqueeze.default:
        return xd + (1 if _norm(node.args[1], out.dim()) <= xd else 0)
    if t in (aten.squeeze.dim, aten.squeeze.dims):
        gone = [i for i in _dims_arg(node, 1, _val(x).dim()) if _val(x).shape[i] == 1]
        return xd - sum(1 for i in gone if i < xd)
    if t == aten.repeat_interleave.self_int:  # block r repeated is block r of the repeat
        return xd
    if t in (aten.slice.Tensor, aten.select.int, aten.narrow.default, aten.index_select.default):
        dim = _norm(_argument(node, 1, "dim", 0), _val(x).dim())
        if dim == xd:
            raise _NoRule(f"{_op(node)} along the sharded dim")
        return xd - 1 if t == aten.select.int and dim < xd else xd
    if t == aten.cat.default:
        tensors = node.args[0]
        ds = {dims.get(a) for a in tensors}
        dim = _norm(_argument(node, 1, "dim", 0), out.dim())
        if len(ds) != 1 or None in ds or dim in ds:
            raise _NoRule("a cat of inputs not all sharded along one other dim")
        return ds.pop()
    if t in _SPLITS or t == aten.unbind.int:
        dim = _split_dim(node)
        if dim == xd:
            raise _NoRule(f"{_op(node)} along the sharded dim (a packed weight without a rule)")
        return tuple(xd - 1 if t == aten.unbind.int and dim < xd else xd for _ in out)
    if t == aten.cross_entropy_loss.default:  # the vocabulary-parallel cross-entropy (VOCAB_CE)
        weight, smoothing = _argument(node, 2, "weight", None), _argument(node, 5, "label_smoothing", 0.0)
        if xd != 1 or _val(x).dim() != 2 or node.args[1] in dims or weight is not None or smoothing:
            raise _NoRule("a cross-entropy other than over [rows, classes] sharded by class (no weight, no smoothing)")
        return None
    if t in (aten.constant_pad_nd.default, aten.pad.default):  # the trailing dims (MLA's values to the key width)
        if 2 * (_val(x).dim() - xd) <= len(node.args[1]):
            raise _NoRule("a pad of the sharded dim")
        return xd
    if t in _NORMS:  # layer_norm / rms_norm over the trailing normalized_shape dims
        if xd >= _val(x).dim() - len(node.args[1]) or any(a in dims for a in _tensor_args(node)[1:]):
            raise _NoRule(f"{_op(node)} over the sharded dim")
        return xd
    if t in _SOFTMAX:
        if _norm(_argument(node, 1, "dim", -1), out.dim()) == xd:
            raise _NoRule("softmax over the sharded dim")
        return xd
    if t in _REDUCE:
        red = _dims_arg(node, 1, _val(x).dim())
        if xd in red:
            raise _NoRule(f"{_op(node)} over the sharded dim")
        keep = (node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False))
        return xd if keep else xd - sum(1 for i in red if i < xd)
    if t in _SDPA:
        q, k, v = node.args[:3]
        if not all(dims.get(a) == 1 and _val(a).dim() == 4 for a in (q, k, v)):
            raise _NoRule("attention whose q, k and v are not all sharded along the heads")
        mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
        if isinstance(mask, fx.Node) and mask not in dims:
            m = _val(mask)
            if m.dim() >= 3 and m.shape[m.dim() - 3] != 1:
                raise _NoRule("a per-head attention mask read along the sharded heads")
        elif isinstance(mask, fx.Node) and dims[mask] != _val(mask).dim() - 3:
            raise _NoRule("an attention mask sharded along another dim than the heads")
        return 1
    if t in _MATMUL:
        a, b = node.args[:2]
        da, db = dims.get(a), dims.get(b)
        if da is None or db is None or _val(a).dim() != _val(b).dim() or da != db or da >= _val(a).dim() - 2:
            raise _NoRule("a matmul whose operands are not both sharded along one batch dim")
        return da
    raise _NoRule(f"no rule for {_op(node)}")


def _split_dim(node: fx.Node) -> int:
    """The dim a split/chunk (argument 2) or unbind (argument 1) cuts, positional or keyword."""
    return _norm(_argument(node, 1 if node.target == aten.unbind.int else 2, "dim", 0), _val(node.args[0]).dim())


def _argument(node: fx.Node, i: int, name: str, default):
    """Argument ``i`` of a call, positional or keyword ``name``, else ``default``."""
    return node.args[i] if len(node.args) > i else node.kwargs.get(name, default)


def _no(d):
    if d is not None:
        raise _NoRule("an indexed tuple")
    return None
