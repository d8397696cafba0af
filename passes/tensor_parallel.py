"""Tensor parallelism found in the captured graph: what the dataflow proves shardable is
sharded over ``tp`` ranks (Megatron's column/row scheme), the rest stays replicated.

The pass follows every value's *placement* through the forward graph: replicated (every tp rank
holds the whole value) or sharded along one tensor dim (rank r holds the r-th of ``tp`` equal
contiguous blocks). Nothing is sharded by module name:

* a **column** linear (``linear``, or ``mm``/``addmm``/``matmul`` by a 2-D parameter: GPT-2's
  ``Conv1D``) reads a replicated input and a weight of its own; its weight's output rows (and
  bias) are sharded, so its output is sharded along the last dim. Its input first goes through
  ``autopar::tp_copy`` (forward: identity; backward: the all-reduce of the input's gradient);
* a **row** linear reads a value sharded along its contracted (last) dim; its weight is sharded
  along the input columns, its output is a partial sum, reduced by ``autopar::tp_reduce``
  (forward: all-reduce; backward: identity), then its bias (replicated) is added once;
* between them, each op follows a rule (``_RULES``): element-wise ops, reshapes (a sharded dim
  split or merged as the leading factor: ``[B, S, H*D] <-> [B, S, H, D]``), transposes,
  permutes, ``unsqueeze``/``expand`` (GQA's key/value head repeat), slices, cats and reductions
  along other dims (RoPE's ``rotate_half``, softmax), attention (SDPA, or scores by ``matmul``)
  with q, k and v sharded along the heads; shape arguments become the rank's local shapes.

A sharded value that reaches an op without a rule (or a rule that does not hold: a reduction
over the sharded dim, a size tp does not divide, a weight used elsewhere, the graph's output)
makes every column linear it came from replicated again, with the reason logged, and the analysis
runs again: a region without rules stays replicated and the run stays exact. Each rank's graph
gets its own slices' shapes; the collectives are differentiable ops, so split_backward's joint
trace puts the backward all-reduces (``tp_copy``'s) where the input gradient is computed (I) and
the weight gradients (W) need no communication: per transformer layer, F holds two
``tp_reduce`` and I two.
"""
from __future__ import annotations

import logging
import math
import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode

from autopar import linear_ce
from autopar.collectives import comms

from . import op_semantics
from .captured import CapturedGraph
from .costs import is_random
from .provenance import module_path, op_name, source_of

log = logging.getLogger("autopar")
aten = torch.ops.aten


# -- the collectives (differentiable graph ops) ---------------------------------------------------------------------


@torch.library.custom_op("autopar::tp_reduce", mutates_args=())
def tp_reduce(x: torch.Tensor, group: str) -> torch.Tensor:
    """Forward: the sum over the tp group (a row linear's partial products); backward: identity."""
    return comms.summed(x, group)


@tp_reduce.register_fake
def _(x, group):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


tp_reduce.register_autograd(lambda ctx, grad: (grad, None))
REDUCE = torch.ops.autopar.tp_reduce.default


@torch.library.custom_op("autopar::tp_copy", mutates_args=())
def tp_copy(x: torch.Tensor, group: str) -> torch.Tensor:
    """Forward: identity (a replicated value entering the tp region); backward: the sum over the
    tp group of the input's gradient (each rank's holds its shard's part only)."""
    return x.clone()


@tp_copy.register_fake
def _(x, group):
    return torch.empty_like(x)


def _copy_setup(ctx, inputs, output):
    ctx.group = inputs[1]


tp_copy.register_autograd(lambda ctx, grad: (torch.ops.autopar.tp_reduce(grad, ctx.group), None),
                          setup_context=_copy_setup)


def _vocab_ce(logits: torch.Tensor, target: torch.Tensor, group: str, start: int, ignore_index: int,
              reduction: int):
    """(the loss, each row's log-sum-exp) of the cross-entropy of rows whose classes are sharded:
    this rank holds classes [start, start + V/tp); max, sum of exponentials and the target's logit
    are reduced over the tp group in fp32 (``linear_ce.sharded_lse``), so the logits are never
    gathered."""
    valid, col, hit = linear_ce.target_columns(logits, target, ignore_index, start)
    lse, picked, _p, _total = linear_ce.sharded_lse(logits.float(), col, hit, group)
    per = torch.where(valid, lse - picked, 0.0)
    loss = per if reduction == 0 else per.sum() if reduction == 2 else per.sum() / valid.sum()
    return loss.to(logits.dtype), lse


@torch.library.custom_op("autopar::vocab_cross_entropy", mutates_args=())
def vocab_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group: str, start: int, ignore_index: int,
                        reduction: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``aten.cross_entropy_loss(logits, target, None, reduction, ignore_index)`` with the classes
    (dim 1 of ``[N, V]``) sharded over tp: (the loss, alike on every rank; each row's log-sum-exp,
    saved for the backward, which needs no communication)."""
    return _vocab_ce(logits, target, group, start, ignore_index, reduction)


@vocab_cross_entropy.register_fake
def _(logits, target, group, start, ignore_index, reduction):
    n = logits.shape[0]
    return logits.new_empty((n,) if reduction == 0 else ()), logits.new_empty((n,), dtype=torch.float32)


@torch.library.custom_op("autopar::vocab_cross_entropy_backward", mutates_args=())
def vocab_cross_entropy_backward(grad: torch.Tensor, logits: torch.Tensor, target: torch.Tensor, lse: torch.Tensor,
                                 start: int, ignore_index: int, reduction: int) -> torch.Tensor:
    """The gradient of this rank's logits: (softmax - one-hot of the target where it is one of
    this rank's classes) times the loss's gradient per row (mean: over the rows not ignored)."""
    valid = target != ignore_index
    g = grad.float()
    scale = g if reduction == 0 else g.expand(target.shape) / (valid.sum() if reduction == 1 else 1)
    p = (logits.float() - lse[:, None]).exp()
    return linear_ce.logits_grad(p, logits, target, ignore_index, [], scale, start)


@vocab_cross_entropy_backward.register_fake
def _(grad, logits, target, lse, start, ignore_index, reduction):
    return torch.empty_like(logits)


def _ce_setup(ctx, inputs, output):
    logits, target, _group, start, ignore_index, reduction = inputs
    ctx.save_for_backward(logits, target, output[1])
    ctx.args = (start, ignore_index, reduction)


def _ce_backward(ctx, grad, _grad_lse):
    logits, target, lse = ctx.saved_tensors
    return (torch.ops.autopar.vocab_cross_entropy_backward(grad, logits, target, lse, *ctx.args),
            None, None, None, None, None)


vocab_cross_entropy.register_autograd(_ce_backward, setup_context=_ce_setup)
VOCAB_CE = torch.ops.autopar.vocab_cross_entropy.default


# -- what the pass returns ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TpShard:
    """One parameter sharded over tp: rank ``rank`` holds block ``rank`` of ``tp`` equal
    contiguous blocks of dim ``dim`` of the whole ``full_shape``."""

    fqn: str
    dim: int
    full_shape: tuple[int, ...]
    tp: int
    rank: int
    parts: tuple[int, ...] = ()  # a packed weight (q, k, v in one): the sizes along dim of its parts, each sharded

    @property
    def size(self) -> int:
        return self.full_shape[self.dim] // self.tp

    @property
    def local_shape(self) -> tuple[int, ...]:
        shape = list(self.full_shape)
        shape[self.dim] = self.size
        return tuple(shape)

    def blocks(self) -> list[tuple[int, int, int]]:
        """(start in the whole, start in this rank's block, length) along ``dim`` of each of its
        pieces: one, or one per part of a packed weight (every part's block r, in order)."""
        out, whole, local = [], 0, 0
        for size in self.parts or (self.full_shape[self.dim],):
            n = size // self.tp
            out.append((whole + self.rank * n, local, n))
            whole, local = whole + size, local + n
        return out

    def local(self, whole: torch.Tensor) -> torch.Tensor:
        """This rank's block of a whole value (of a packed one: its block of each part, in order)."""
        return torch.cat([whole.narrow(self.dim, a, n) for a, _l, n in self.blocks()], self.dim)

    def pieces(self) -> list[tuple[slice, ...]]:
        """The index of each piece of the whole tensor this rank's block is made of, in order
        (one per packed part), concatenated along ``dim``: what a meta build reads from a file
        (rows for dim 0, a strided block of columns for dim 1)."""
        return [(slice(None),) * self.dim + (slice(a, a + n),) for a, _l, n in self.blocks()]

    def whole_boxes(self, offsets: tuple, sizes: tuple, t: torch.Tensor) -> list[tuple[tuple, tuple, torch.Tensor]]:
        """A box of this rank's block (``offsets``, ``sizes`` in the block's coordinates, data
        ``t``) as boxes of the whole tensor (checkpoints): shifted along ``dim`` to the block's
        place, cut where a packed weight's parts meet (each part's block lies elsewhere)."""
        out = []
        a0, n0 = offsets[self.dim], sizes[self.dim]
        for whole, local, n in self.blocks():
            a, b = max(a0, local), min(a0 + n0, local + n)
            if a < b:
                off, sz = list(offsets), list(sizes)
                off[self.dim], sz[self.dim] = whole + (a - local), b - a
                out.append((tuple(off), tuple(sz), t.narrow(self.dim, a - a0, b - a)))
        return out

    def whole(self, blocks: list[torch.Tensor]) -> torch.Tensor:
        """The whole value from every rank's block, in tp rank order (``local``'s inverse)."""
        return torch.cat([b.narrow(self.dim, local, n) for _a, local, n in self.blocks() for b in blocks], self.dim)


@dataclass
class TensorParallelResult:
    captured: CapturedGraph
    shards: dict[str, TpShard]          # fqn -> its shard
    columns: list[str]                  # the sharded linears' node names
    rows: list[str]
    replicated: list[str]               # why each region stayed replicated (one line each)
    roles: dict[str, str] = field(default_factory=dict)  # module path -> column- / row-parallel


# -- the analysis ---------------------------------------------------------------------------------------------------


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


@dataclass
class _Linear:
    node: fx.Node
    x: fx.Node
    weight: fx.Node
    bias: fx.Node | None
    out_dim: int  # the weight dim of the output features
    in_dim: int   # the weight dim contracted with x's last dim
    parts: tuple[int, ...] = ()  # a packed column: the sizes its output is split into, each sharded


def _linear(node: fx.Node, params: dict) -> _Linear | None:
    """A linear layer by a 2-D parameter: ``linear(x, W[out, in], b)``, ``addmm(b, x, W[in, out])``,
    ``mm``/``matmul(x, W[in, out])`` (GPT-2's ``Conv1D``)."""
    t, a = node.target, node.args
    if t == aten.linear.default:
        x, w, b = a[0], a[1], (a[2] if len(a) > 2 else node.kwargs.get("bias"))
        out_dim, in_dim = 0, 1
    elif t == aten.addmm.default and len(a) == 3 and not node.kwargs:
        b, x, w = a
        out_dim, in_dim = 1, 0
    elif t in (aten.mm.default, aten.matmul.default):
        x, w = a[:2]
        b, out_dim, in_dim = None, 1, 0
    else:
        return None
    if not (isinstance(w, fx.Node) and w.op == "placeholder" and w.name in params and _val(w).dim() == 2):
        return None
    if b is not None and not (isinstance(b, fx.Node) and b.op == "placeholder" and b.name in params
                              and _val(b).dim() == 1):
        return None
    return _Linear(node, x, w, b, out_dim, in_dim)


def _packed_column(node: fx.Node, dims: dict, columns: dict, tp: int):
    """The column linear whose output ``node`` splits along the sharded dim into parts tp
    divides (one packed weight for q, k and v, or gate and up), reached through views that keep
    that dim whole and have no other user; None when ``node`` is not such a split."""
    if node.target not in (aten.split.Tensor, aten.split_with_sizes.default):
        return None
    x = node.args[0]
    d = dims.get(x)
    dim = _split_dim(node)
    if d != dim or any(v.shape[dim] % tp for v in _val(node)):
        return None
    width = _val(x).shape[dim]
    n = x
    while n not in columns:
        if n.target not in _VIEWS | _SAME or len(n.users) != 1 or _val(n).shape[dims[n]] != width:
            return None
        n = n.args[0]
    return n if len(n.users) == 1 and _val(n).shape[-1] == width and not columns[n].parts else None


@dataclass
class _Analysis:
    dims: dict          # node -> sharded dim (int, or a tuple for tuple results)
    columns: dict       # node -> _Linear
    rows: dict          # node -> _Linear
    origin: dict        # node -> frozenset of the column nodes its shard came from
    narrows: dict = field(default_factory=dict)  # node -> [(replicated input, dim, blocks)] (``narrowed``)
    vocab: dict = field(default_factory=dict)    # vocabulary-parallel embedding node -> its weight placeholder

    def shards(self, params: dict, tp: int, rank: int) -> dict[str, TpShard]:
        """FQN -> how rank ``rank`` holds each parameter it shards: a column's weight by its
        output features (and its bias), a row's by its input features (its bias stays whole)."""
        out = {}
        for lins, role in ((self.columns, "out_dim"), (self.rows, "in_dim")):
            for lin in lins.values():
                held = [(lin.weight, getattr(lin, role))] + ([(lin.bias, 0)] if lin.bias is not None
                                                             and role == "out_dim" else [])
                for ph, dim in held:
                    out[params[ph.name]] = TpShard(params[ph.name], dim, tuple(_val(ph).shape), tp, rank, lin.parts)
        for ph in self.vocab.values():  # an embedding's rows (its vocabulary)
            out[params[ph.name]] = TpShard(params[ph.name], 0, tuple(_val(ph).shape), tp, rank)
        return out

    def roles(self, params: dict) -> dict[str, str]:
        """Module path -> "column-parallel" / "row-parallel" of every sharded linear."""
        return {params[w.name].rsplit(".", 1)[0]: role
                for ws, role in (([lin.weight for lin in self.columns.values()], "column-parallel"),
                                 ([lin.weight for lin in self.rows.values()], "row-parallel"),
                                 (list(self.vocab.values()), "vocabulary-parallel"))
                for w in ws}


def _vocab_embedding(node: fx.Node, params: dict, inputs, tp: int) -> fx.Node | None:
    """The weight of an embedding looked up by a model input (token ids) that tp shards by its
    rows (vocabulary-parallel: each rank looks up the ids in its rows, zeros for the others, and
    the outputs are summed over tp); None for other embeddings (positions computed in the graph
    stay replicated: small, and their sum would cost an all-reduce)."""
    if node.target != aten.embedding.default:
        return None
    w, ids = node.args[:2]
    if not (isinstance(w, fx.Node) and w.op == "placeholder" and w.name in params and _val(w).dim() == 2
            and len(w.users) == 1 and _val(w).shape[0] % tp == 0 and isinstance(ids, fx.Node)
            and ids.op == "placeholder" and ids.name in inputs):
        return None
    if any(node.args[3:5]):  # scale_grad_by_freq, sparse
        return None
    return w


def _analyze(graph: fx.Graph, params: dict, tp: int, off: set, inputs=()):
    """One pass over the graph with the column linears in ``off`` kept replicated: the analysis,
    or (the column nodes to turn off, the reason) at the first place a shard has no rule."""
    dims, origin, columns, rows, narrows, vocab = {}, {}, {}, {}, {}, {}
    for node in graph.nodes:
        w = _vocab_embedding(node, params, inputs, tp) if node.op == "call_function" else None
        if w is not None:
            vocab[node] = w
            continue
        if node.op == "output":
            bad = [a for a in _tensor_args(node) if a in dims]
            if bad:
                return frozenset().union(*(origin[a] for a in bad)), f"{bad[0].name} leaves the graph sharded"
            continue
        if node.op != "call_function":
            continue
        sharded = [a for a in _tensor_args(node) if a in dims]
        lin = _linear(node, params)
        if lin is not None and not sharded:
            if node in off:
                continue
            if len(lin.weight.users) > 1 or (lin.bias is not None and len(lin.bias.users) > 1):
                why = "its weight is also used elsewhere (tied)"
            elif _val(lin.weight).shape[lin.out_dim] % tp:
                why = f"{_val(lin.weight).shape[lin.out_dim]} output features are not divisible by tp={tp}"
            else:
                columns[node] = lin
                dims[node], origin[node] = _val(node).dim() - 1, frozenset({node})
                continue
            log.debug("autopar: tensor parallel: %s stays replicated: %s", _where(node), why)
            continue
        if not sharded:
            continue
        src = frozenset().union(*(origin[a] for a in sharded))
        if lin is not None:
            shared = len(lin.weight.users) > 1 or (lin.bias is not None and len(lin.bias.users) > 1)
            if dims[lin.x] != _val(lin.x).dim() - 1 or sharded != [lin.x] or shared:
                return src, (f"{_where(node)}: a linear reads a value sharded along dim {dims[lin.x]}, not its "
                             "contracted dim" if not shared else f"{_where(node)}: its weight is also used elsewhere")
            rows[node] = lin
            continue
        packed = _packed_column(node, dims, columns, tp)
        if packed is not None:  # a packed column's parts: each rank gets its block of each
            columns[packed].parts = tuple(int(v.shape[dims[node.args[0]]]) for v in _val(node))
            dims[node], origin[node] = tuple(dims[node.args[0]] for _ in _val(node)), src
            continue
        try:
            cut = narrowed(node, dims, tp)
            d = _rule(node, {**dims, **{a: i for a, i, _n in cut}}, tp)
        except _NoRule as e:
            return src, f"{_where(node)}: {e}"
        if cut:
            narrows[node] = cut
        if d is not None:
            dims[node], origin[node] = d, src
    return _Analysis(dims, columns, rows, origin, narrows, vocab)


def analyze(captured: CapturedGraph, tp: int):
    """(the analysis, one line per region kept replicated): regions are dropped until every
    shard has a rule."""
    off: set = set()
    replicated = []
    while True:
        res = _analyze(captured.gm.graph, captured.params, tp, off, set(captured.inputs))
        if isinstance(res, _Analysis):
            return res, replicated
        cols, why = res
        names = sorted({captured.params[_linear(c, captured.params).weight.name].rsplit(".", 1)[0] for c in cols})
        replicated.append(f"{', '.join(names)} kept replicated: {why}")
        off |= cols


def tp_plan_disagreements(model, roles: dict[str, str]) -> list[str]:
    """Where a Hugging Face model's own tensor-parallel plan (``model._tp_plan``, full module
    paths with ``*`` for indices; else ``config.base_model_tp_plan`` under the base model's
    prefix) and what the graph proved differ: one line per module, HF's style beside the pass's
    choice (``roles``: ``TensorParallelResult.roles``). A hint only: the pass never follows it
    (what it shards is proved exact)."""
    import fnmatch

    plan = dict(getattr(model, "_tp_plan", None) or {})
    config = getattr(model, "config", None)
    if not plan and getattr(config, "base_model_tp_plan", None):
        prefix = getattr(model, "base_model_prefix", "")
        plan = {(f"{prefix}.{k}" if prefix and hasattr(model, prefix) else k): v
                for k, v in config.base_model_tp_plan.items()}
    if not plan:
        return []
    out = []
    for path, _module in model.named_modules():
        style = next((v for k, v in plan.items() if fnmatch.fnmatchcase(path, k)), None)
        if style is None:
            continue
        theirs = ("column-parallel" if style.startswith("colwise") else "row-parallel" if style.startswith("rowwise")
                  else "vocabulary-parallel" if style.startswith("embedding") else None)
        mine = roles.get(path, "replicated")
        if theirs is not None and theirs != mine:
            out.append(f"{path}: Hugging Face's tp_plan says {style!r} ({theirs}); the graph keeps it {mine}")
    return out


# -- the rewrite ----------------------------------------------------------------------------------------------------


def _local_shape(val: torch.Tensor, d: int, tp: int) -> list[int]:
    shape = list(val.shape)
    shape[d] //= tp
    return shape


def apply_tensor_parallel(captured: CapturedGraph, tp: int, tp_rank: int, group) -> TensorParallelResult:
    """A new capture whose graph is this tp rank's, and the parameters it shards (the input
    capture is not changed)."""
    group_name = group if isinstance(group, str) else group.group_name
    out = captured.copy()
    graph = out.gm.graph
    an, replicated = analyze(out, tp)
    for line in replicated:
        log.info("autopar: tensor parallel: %s", line)
    shards = an.shards(captured.params, tp, tp_rank)
    fake_mode = detect_fake_mode([n.meta["val"] for n in graph.nodes if n.op == "placeholder"])
    with fake_mode:
        for node in graph.nodes:
            if node.op == "placeholder" and node.name in captured.params and captured.params[node.name] in shards:
                node.meta["val"] = node.meta["val"].new_empty(shards[captured.params[node.name]].local_shape)
        copies: dict = {}
        graded_values = graded(out)

        def copy_of(x: fx.Node, before: fx.Node) -> fx.Node:
            if x not in copies:  # one copy per value, before its first reader in the tp region
                with graph.inserting_before(before):
                    copies[x] = new_node(graph, torch.ops.autopar.tp_copy.default, (x, group_name), before)
            return copies[x]

        for node in list(graph.nodes):
            if node in an.dims and node not in an.columns:
                # a replicated operand with a gradient (a q/k norm's weight, a learned scale) read
                # by a sharded op gets only this rank's part of its gradient: tp_copy sums them
                for a in _tensor_args(node):
                    if a not in an.dims and a in graded_values:
                        node.replace_input_with(a, copy_of(a, node))
                for a, d, n in an.narrows.get(node, ()):  # read along the sharded dim: the rank's block
                    src = copies.get(a, a)
                    size = _val(a).shape[d] // n
                    with graph.inserting_before(node):
                        node.replace_input_with(src, new_node(graph, aten.narrow.default,
                                                              (src, d, tp_rank * n // tp * size, size), node))
            if node in an.vocab:
                _vocab_lookup(graph, node, tp, tp_rank, group_name)
                continue
            if node.target == aten.cross_entropy_loss.default and node.args[0] in an.dims:
                x, target = node.args[:2]  # (x already holds this rank's classes)
                with graph.inserting_before(node):
                    ce = new_node(graph, VOCAB_CE, (x, target, group_name, tp_rank * _val(x).shape[1],
                                                    _argument(node, 4, "ignore_index", -100),
                                                    _argument(node, 3, "reduction", 1)), node)
                    loss = new_node(graph, operator.getitem, (ce, 0), node)
                node.replace_all_uses_with(loss)
                if out.loss == node.name:
                    out.loss = loss.name
                graph.erase_node(node)
                continue
            if node in an.columns:
                x = an.columns[node].x
                node.replace_input_with(x, copy_of(x, node))
                refresh_val(node)
            elif node in an.rows:
                lin = an.rows[node]
                if lin.bias is not None:  # added once, after the sum
                    node.target = aten.linear.default if node.target == aten.linear.default else aten.mm.default
                    node.args, node.kwargs = (lin.x, lin.weight), {}
                refresh_val(node)
                users = list(node.users)
                with graph.inserting_after(node):
                    red = new_node(graph, torch.ops.autopar.tp_reduce.default, (node, group_name), node)
                last = red
                if lin.bias is not None:
                    with graph.inserting_after(red):
                        last = new_node(graph, aten.add.Tensor, (red, lin.bias), node)
                for u in users:
                    u.replace_input_with(node, last)
            elif node in an.dims:
                localize(node, an.dims[node], tp)
    graph.lint()
    out.gm.recompile()
    return TensorParallelResult(out, shards, [n.name for n in an.columns], [n.name for n in an.rows], replicated,
                                an.roles(captured.params))


def _vocab_lookup(graph: fx.Graph, node: fx.Node, tp: int, tp_rank: int, group_name: str) -> None:
    """A vocabulary-parallel embedding on this rank: the ids in its rows looked up, the others
    (and their gradients) zero, the outputs summed over tp (``tp_reduce``)."""
    w, ids = node.args[:2]
    n = _val(w).shape[0]  # (the placeholder holds this rank's rows already)
    start = tp_rank * n
    users = list(node.users)
    with graph.inserting_before(node):
        local = new_node(graph, aten.sub.Tensor, (ids, start), node)
        outside = new_node(graph, aten.bitwise_or.Tensor, (new_node(graph, aten.lt.Scalar, (local, 0), node),
                                                           new_node(graph, aten.ge.Scalar, (local, n), node)), node)
        safe = new_node(graph, aten.masked_fill.Scalar, (local, outside, 0), node)
    pad = node.args[2] if len(node.args) > 2 else -1
    node.args = (w, safe) + ((pad - start if start <= pad < start + n else -1,) if len(node.args) > 2 else ())
    refresh_val(node)
    with graph.inserting_after(node):
        keep = new_node(graph, aten.unsqueeze.default, (outside, -1), node)
    with graph.inserting_after(keep):
        zeroed = new_node(graph, aten.masked_fill.Scalar, (node, keep, 0.0), node)
    with graph.inserting_after(zeroed):
        red = new_node(graph, torch.ops.autopar.tp_reduce.default, (zeroed, group_name), node)
    for u in users:
        u.replace_input_with(node, red)


def localize(node: fx.Node, d, tp: int) -> None:
    """A node sharded along ``d`` gets the rank's shapes: a view's or expand's size argument, a
    packed column's split sizes (the local parts); then its value is computed again."""
    if node.target in _VIEWS or node.target == aten.expand.default:
        node.args = (node.args[0], _local_shape(node.meta["val"], d, tp), *node.args[2:])
    elif node.target in (aten.split.Tensor, aten.split_with_sizes.default) and _split_dim(node) == d[0]:
        sizes = node.args[1]
        node.args = (node.args[0], [n // tp for n in sizes] if isinstance(sizes, (list, tuple)) else sizes // tp,
                     *node.args[2:])
    refresh_val(node)


def graded(captured: CapturedGraph) -> set:
    """The floating values that may carry a gradient: those computed from a parameter or a
    floating model input (a later stage's input is an activation)."""
    out = set()
    for node in captured.gm.graph.nodes:
        v = _val(node)
        vs = v if isinstance(v, (list, tuple)) else [v]  # (a split's parts: its getitems read them)
        if not any(isinstance(x, torch.Tensor) and x.is_floating_point() for x in vs):
            continue
        if node.op == "placeholder" and (node.name in captured.params or node.name in captured.inputs) or \
                any(a in out for a in node.all_input_nodes):
            out.add(node)
    return out


def new_node(graph: fx.Graph, target, args: tuple, like: fx.Node) -> fx.Node:
    node = graph.call_function(target, args, {})
    node.meta["val"] = target(*fx.node.map_arg(args, lambda a: a.meta["val"]))
    for key in ("nn_module_stack", "stack_trace", "source_fn_stack", "from_node"):
        if key in like.meta:
            node.meta[key] = like.meta[key]
    return node


def refresh_val(node: fx.Node) -> None:
    if node.meta.get("val") is None:
        return
    vals = fx.node.map_arg(node.args, lambda a: a.meta["val"])
    kvals = fx.node.map_arg(node.kwargs, lambda a: a.meta["val"])
    node.meta["val"] = node.target(*vals, **kvals)
