"""Context parallelism's op tables (which attention ops it rewrites, which ops a mask or a
position table may pass through), what its analysis finds (``_Mask``, ``_Attention``, ``_Plan``)
and the checks and argument helpers the analysis and the rewrite share (passes/context_parallel.py
describes the pass)."""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from autopar.collectives import comms

from . import op_semantics
from .captured import CapturedGraph
from .provenance import module_path, op_name, source_of

aten = torch.ops.aten


# Attention ops this pass rewrites. q, k, v are their first three arguments, [B, H, S, D];
# output 0 is the attention output with q's shape (except Dv).
ATTENTION_OPS = {
    aten.scaled_dot_product_attention.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_cudnn_attention.default,
    aten._scaled_dot_product_fused_attention_overrideable.default,
    aten._scaled_dot_product_attention_math.default,
}
_MASK_ARGS = ("attn_mask", "attn_bias")  # masks over [.., S, S]: rebuilt for the whole sequence
_REFUSED_ARGS = ("dropout_mask",)  # a random [.., S, S] tensor drawn outside: cannot be rebuilt

_ARANGE = {aten.arange.default, aten.arange.start, aten.arange.start_step}
# ops a position table may pass through between its placeholder and the slice that picks positions
_TABLE_CHAIN = {aten._to_copy.default, aten.clone.default, aten.alias.default, aten.detach.default,
                aten.lift_fresh_copy.default, aten.unsqueeze.default, aten.slice.Tensor}
_SOFTMAX = op_semantics.SOFTMAX  # attention probabilities (passes/op_semantics.py)
_MATMUL = op_semantics.MATMUL
_DROPOUT = {aten.dropout.default, aten.native_dropout.default}
# reductions a region may take over the keys, keeping the dim (the row max subtracted before the softmax)
_ROW_REDUCE = {aten.max.dim, aten.amax.default, aten.logsumexp.default}
# element-wise (broadcasting) ops torch does not tag pointwise
_ELEMENTWISE = {aten.__and__.Tensor, aten.__or__.Tensor, aten.__xor__.Tensor, aten.__and__.Scalar,
                aten.__or__.Scalar, aten.where.ScalarOther, aten.where.ScalarSelf, aten.where.Scalar,
                aten.masked_fill.Tensor, aten._to_copy.default, aten.type_as.default, aten.lift_fresh_copy.default,
                aten.alias.default, aten.detach.default, aten.clone.default, aten.floor_divide.default,
                aten.scalar_tensor.default}
# ops whose value does not depend on their tensor argument (only its dtype/device)
_SHAPE_ONLY = {aten.new_ones.default, aten.new_zeros.default, aten.new_full.default, aten.new_empty.default}
# factories without tensor arguments
_FACTORY = {aten.zeros.default, aten.ones.default, aten.full.default, aten.empty.memory_format,
            aten.scalar_tensor.default}
_VIEWS = op_semantics.VIEWS
# ops whose value ignores their tensor argument but whose shape follows it
_LIKE = {aten.zeros_like.default, aten.ones_like.default, aten.full_like.default, aten.empty_like.default}
# reductions a mask may take over a whole dim (chunked attention's left padding: attention_mask.cumsum(-1) ... .sum(-1))
_REDUCE = {aten.sum.dim_IntList, aten.sum.default, aten.any.dim, aten.any.dims, aten.any.default, aten.all.dim,
           aten.all.dims, aten.all.default, aten.amax.default, aten.amin.default}
# ops whose size-list argument (index 0 or 1) gives the output shape: resized along dims read whole
_SIZED = {aten.expand.default: 1, aten.view.default: 1, aten._unsafe_view.default: 1, aten.reshape.default: 1,
          aten.new_ones.default: 1, aten.new_zeros.default: 1, aten.new_full.default: 1, aten.new_empty.default: 1,
          aten.zeros.default: 0, aten.ones.default: 0, aten.full.default: 0, aten.empty.memory_format: 0}
_ASSERT = aten._assert_tensor_metadata.default
_Q, _KV, _ABS = "q", "kv", "abs"  # mask dim roles: query position, key position, absolute index into a sequence


def _elementwise(target) -> bool:
    return target in _ELEMENTWISE or (isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags)


@dataclass
class _Mask:
    """A mask value an attention consumes, and how to rebuild it for the whole sequence."""
    out: fx.Node
    roles: tuple                 # role of each dim of `out`: _Q on dim -2, _KV on -1 (when not 1)
    uses: frozenset              # roles its value depends on (_Q, _KV: per block; _ABS: gathered inputs)
    causal: bool                 # statically kv <= q, consumed by SDPA only: is_causal replaces it


@dataclass
class _Attention:
    kind: str                    # "sdpa" or "region"
    node: fx.Node                # the SDPA node, or the region's p @ v matmul
    q: fx.Node
    k: fx.Node                   # region: k^T, [B, H, D, s]
    v: fx.Node
    heads: int                   # query heads (a mask's head dim of this size is narrowed)
    masks: list                  # (consumer node, arg name or loc (_get_loc), _Mask | None for a head-only tensor)
    region: list = field(default_factory=list)  # region: score matmul .. p @ v matmul, in graph order
    sides: list = field(default_factory=list)   # region: (cat node, loc) of per-head extra logits [B, H, s, k]
    slices: list = field(default_factory=list)  # region: (slice node, offset) dropping the extra logits' columns


@dataclass
class _Plan:
    attentions: list
    masks: dict                  # mask out node -> _Mask
    roles: dict                  # (mask node, roles of its dims) -> uses, for every mask node reached
    inputs: set                  # model-input placeholders masks read (all-gathered over cp)
    state: set                   # names of the buffer/constant placeholders
    erase: set                   # nodes only masks use: erased after the rewrite
    aranges: list
    slices: list


# ---------------------------------------------------------------------------------------------
# checks shared with the rewrite


def _group_name(group, cp: int, cp_rank: int) -> str:
    if isinstance(group, str) or comms.is_process_group(group):
        pg = comms.process_group(group)
    else:
        raise ValueError(f"autopar: the cp group must be a ProcessGroup or a group name, got {type(group).__name__}")
    if pg.size() != cp or pg.rank() != cp_rank:
        raise ValueError(f"autopar: cp={cp}, cp_rank={cp_rank}, but the cp group has {pg.size()} ranks and this "
                         f"process is its rank {pg.rank()}; pass the group whose rank i holds sequence shard i")
    return pg.group_name


def _shard_length(captured: CapturedGraph) -> int:
    """s: the dim-1 length every input and the target were captured with."""
    names = list(captured.inputs) + ([captured.target] if captured.target is not None else [])
    shapes = {name: tuple(captured.node(name).meta["val"].shape) for name in names}
    lengths = {shape[1] for shape in shapes.values() if len(shape) >= 2}
    bad = {name: shape for name, shape in shapes.items() if len(shape) < 2}
    if not names or bad or len(lengths) != 1:
        raise ValueError(f"autopar: context parallelism shards every input and the target along dim 1 (the "
                         f"sequence); the captured shapes are {shapes}. Capture with each tensor's sequence shard "
                         "([microbatch, S/cp, ...]) or use cp=1")
    return lengths.pop()


def _arg(node: fx.Node, name: str):
    """Argument `name` of an OpOverload call, positional, keyword or default."""
    for i, a in enumerate(node.target._schema.arguments):
        if a.name == name:
            if not a.kwarg_only and i < len(node.args):
                return node.args[i]
            return node.kwargs.get(name, a.default_value if a.has_default_value() else None)
    raise KeyError(name)


def _has_arg(node: fx.Node, name: str) -> bool:
    return any(a.name == name for a in node.target._schema.arguments)


def _set_arg(node: fx.Node, name: str, value) -> None:
    for i, a in enumerate(node.target._schema.arguments):
        if a.name == name:
            if not a.kwarg_only and i < len(node.args):
                args = list(node.args)
                args[i] = value
                node.args = tuple(args)
            else:
                node.kwargs = {**node.kwargs, name: value}
            return
    raise KeyError(name)


_op_name = op_name


def _where(node: fx.Node) -> str:
    path = module_path(node)
    return f"{node.name} ({path})" if path else node.name


def _error(node: fx.Node, why: str) -> ValueError:
    src = source_of(node)
    at = f" [node {node.name}" + (f", from {src}" if src else "") + "]"
    return ValueError(f"autopar: context parallelism cannot rewrite this graph: {why}.{at}")


def _check_sdpa(node: fx.Node, cp: int, s: int) -> _Attention:
    op = node.target._schema.name.split("::")[-1]
    what = f"attention {_where(node)}" + ("" if node.name.startswith(op) else f" ({op})")
    for name in _REFUSED_ARGS:
        if _has_arg(node, name) and _arg(node, name) is not None:
            raise _error(node, f"{what} takes an explicit {name}; context parallelism cannot rebuild a random "
                               "[S, S] tensor drawn outside the attention. Use dropout_p, or cp=1")
    q, k, v = (a.meta["val"] for a in node.args[:3])
    _check_qkv(node, what, q, k, v, cp, s, gqa=_grouped(node))
    if not isinstance(node.meta["val"], torch.Tensor):
        returns = node.target._schema.returns
        for user in node.users:
            if user.target is not operator.getitem:
                raise _error(node, f"{what}: its output tuple is used as a whole by {user.name}")
            i = user.args[1]
            if i != 0 and user.users:
                raise _error(node, f"{what}: output {i} ({returns[i].name or 'unnamed'}) is used by "
                                   f"{', '.join(u.name for u in user.users)}; context parallelism can only rewrite "
                                   "the attention output (output 0): the others would cover the full sequence of H/cp "
                                   "heads. Use F.scaled_dot_product_attention and its output only, or cp=1")
    return _Attention("sdpa", node, node.args[0], node.args[1], node.args[2], int(q.shape[1]), [])


def _grouped(node: fx.Node) -> bool:
    """An SDPA that reads key/value head h // (Hq / Hkv) for query head h (``enable_gqa``)."""
    return _has_arg(node, "enable_gqa") and bool(_arg(node, "enable_gqa"))


def grouped_kv_heads(node: fx.Node) -> int:
    """Hkv of a grouped-query SDPA with fewer key/value heads than query heads, whose key/value
    heads context parallelism repeats as far as cp needs (``kv_repeats``); 0 for any other op."""
    if not _grouped(node):
        return 0
    hq, hk = (int(a.meta["val"].shape[1]) for a in node.args[:2])
    return hk if hk != hq else 0


def kv_repeats(hkv: int, cp: int) -> int:
    """How many copies of each key/value head a grouped-query attention (Hq query heads over Hkv
    key/value heads, cp dividing Hq) sends through Ulysses' all-to-all: each rank gets Hq/cp query heads
    and needs the key/value heads those read; when cp does not divide Hkv (cp > Hkv, as Megatron
    does under TP), every head is repeated cp / gcd(Hkv, cp) times first, so the lcm(Hkv, cp)
    heads split evenly and rank r gets exactly the ones its query heads read."""
    return 1 if hkv % cp == 0 else cp // math.gcd(hkv, cp)


def cp_heads(node: fx.Node) -> int:
    """The head count cp must divide for this attention op: its query heads when it is a
    grouped-query SDPA (key/value heads are repeated as needed, ``kv_repeats``), else the largest
    count its q, k and v heads all divide (0 when they are not [B, H, S, D])."""
    vals = [a.meta.get("val") if isinstance(a, fx.Node) else None for a in node.args[:3]]
    if any(v is None or v.dim() != 4 for v in vals):
        return 0
    hq, hk, hv = (int(v.shape[1]) for v in vals)
    if _grouped(node) and hk == hv and hq % hk == 0:
        return hq
    return math.gcd(hq, math.gcd(hk, hv))


def _check_qkv(node, what: str, q, k, v, cp: int, s: int, k_transposed: bool = False, gqa: bool = False) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise _error(node, f"{what} takes q/k/v of shapes {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}; "
                           "context parallelism needs [batch, heads, seq, head_dim]")
    k_len = k.shape[3] if k_transposed else k.shape[2]
    if q.shape[2] != s or k_len != s or v.shape[2] != s:
        raise _error(node, f"{what} attends {q.shape[2]} queries over {k_len} keys, but the sequence shard is {s} "
                           "long; context parallelism rewrites self-attention over the sharded sequence only (no "
                           "cross-attention, no KV cache). Use cp=1")
    hq, hk, hv = q.shape[1], k.shape[1], v.shape[1]
    if gqa and hk == hv and hq % hk == 0:
        if hq % cp:
            raise _error(node, f"{what} has {hq} query heads over {hk} key/value heads; cp={cp} must divide the "
                               f"query heads (Ulysses gives each cp rank {hq}/cp of them): use a cp that divides {hq}")
        return
    if hq % cp or hk % cp or hv % cp:
        g = math.gcd(hq, hk, hv)
        fix = f"use a cp that divides {g}" if g > 1 else "use cp=1"
        if hq % cp == 0:
            fix += ", or call SDPA with enable_gqa=True (key/value heads are then repeated only as far as cp needs)"
        raise _error(node, f"{what} has {hq} query heads and {hk}/{hv} key/value heads; cp={cp} must divide "
                           f"every head count (Ulysses gives each cp rank H/cp heads): {fix}")
