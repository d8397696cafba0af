"""Ulysses context parallelism as a graph pass: attention all-to-all over the sequence shards.

Contract. The graph was captured at the LOCAL sequence length: the caller cut every model input
and the target along dim 1 into ``cp`` equal contiguous shards, and cp rank ``r`` captured with
shard ``r`` (shape ``[mb, s]``, ``s = S / cp``). ``apply_context_parallel`` rewrites that graph
so that it computes, for the rank's ``s`` positions, exactly what the full-sequence model does.
``context_parallel_blocker(captured, cp)`` runs the same checks without rewriting (for the planner).

* Attention, two forms.
  - Every scaled-dot-product attention node (``aten.scaled_dot_product_attention`` as
    torch.export keeps it, and the backend forms ``_scaled_dot_product_flash_attention_for_cpu``,
    ``_flash_attention``, ``_efficient_attention``, ``_cudnn_attention``,
    ``_fused_attention_overrideable``, ``_attention_math``).
  - An attention region written out by hand (Hugging Face "eager" attention, e.g. Gemma2's
    soft-capped one, GPT-OSS's with sinks): ``scores = q @ k^T`` (a 4-d ``matmul``), then ops that
    are per (batch, head, query) and element-wise along the keys except for reductions over the
    keys that keep the dim (scale, soft-cap ``tanh``, an additive or boolean mask, dtype casts, the
    row max subtracted: ``max``/``amax``/``logsumexp`` over dim -1, and once, extra logits
    concatenated along the keys: ``cat([scores, sinks], -1)`` with ``sinks`` ``[B, H, s, k]``), one
    ``softmax`` over the last dim, element-wise ops (dropout, casts, and the slice that drops the
    extra logits' columns), and ``out = p @ v``. It is found from the softmax (every softmax over
    ``[.., s, s]`` scores must belong to one; one over ``[.., s, s + k]`` does when a score matmul
    leads to it), walking back through those ops (a DAG: the row max reads the scores twice) to
    the score matmul and forward to the value matmul; q, k^T and v are the two matmuls' operands,
    i.e. after RoPE and after GQA's repeat of the k/v heads, and before the output projection.
    Extra logits computed from parameters (sinks: per-head parameters expanded over batch and
    queries) go through the same all-to-all as q, so each rank gets those of its heads for all
    queries; the drop-the-sinks slice is rewritten to the ``S`` score columns.
  Either becomes
      q, k, v  [B, H, s, D]  --all-to-all-->  [B, H/cp, S, D]   (sequence blocks in rank order)
      the same attention on the whole sequence (SDPA's ``is_causal`` keeps its meaning; a region's
      element-wise ops are shape-agnostic and rerun on [B, H/cp, S, S] scores)
      out [B, H/cp, S, D]   --all-to-all-->  [B, H, s, D]        (same strides as before)
  A grouped-query SDPA (``enable_gqa=True``: Hq query heads over Hkv key/value heads) needs cp to
  divide Hq only: when cp does not divide Hkv, each key/value head is first repeated
  ``kv_repeats(Hkv, cp)`` times on the rank's shard, so every rank receives exactly the
  key/value heads its Hq/cp query heads read (one each when cp >= Hkv, Megatron's rule for GQA
  under tensor parallelism); the all-to-all then carries that many copies of k and v.
  with ``torch.ops._c10d_functional.all_to_all_single`` + ``wait_tensor``: what
  ``_functional_collectives.all_to_all_single_autograd`` records under make_fx. Its autograd
  formula is registered when ``torch.distributed._functional_collectives`` is imported (this
  module does), so split_backward's joint trace gets the backward all-to-alls for free; they land
  in whichever program computes the gradient through them (I, or W for a stage with no
  differentiable input).
* Masks (SDPA's ``attn_mask``/``attn_bias``, and the tensors a region adds to or masks its scores
  with) must not depend on parameters; they are computed in the graph from positions (``arange``,
  slices of buffers such as a ``tril`` table), constants and model inputs (a ``[B, S]`` padding
  ``attention_mask``, sharded with the data). On the rank, the mask of the local block only exists;
  attention over the whole sequence needs all ``cp x cp`` blocks. Each mask is rebuilt block by
  block: its subgraph is copied once per (query block a, key block b), with every position that
  lands on the query dim (-2) moved to block a, every one on the key dim (-1) to block b (found by
  following each dim of the mask back through broadcasts, ``unsqueeze``, ``expand``, views that only
  add size-1 dims, ``index`` and element-wise ops: one arange used for both dims is copied for
  each), and every model input read by position replaced by its all-gather over the cp group
  (``all_gather_into_tensor``; a value read element-wise takes its block of the gathered input).
  A tensor the mask reads by position (``index``: transformers' ``position_ids[b_idx, q_idx]``
  with use_cache=False, remapping positions for packed sequences) is rebuilt over the whole
  sequence instead of a block: an ``arange`` of ``s`` positions becomes ``arange(start, start + S)``,
  a model input its all-gather, a buffer slice ``[start, start + S)``, sizes ``s`` in views/expands
  along such dims become ``S``; so a ``cumsum``/``diff`` (the packed-sequence ids), a reduction
  (chunked attention's left padding ``(mask.cumsum(-1) == 0).sum(-1)``) or a fixed window at the
  start (``position_ids[:, :1]``) over it sees the whole sequence, as in the unsharded model (over a
  query/key block they are refused).
  The blocks are concatenated into the ``[.., S, S]`` mask; a head dim of size H is narrowed to
  the rank's H/cp heads. All blocks keep the shapes the graph was traced with, so no size in the
  mask code needs to be understood. A mask that is statically ``kv <= q`` (the causal mask
  transformers materializes for SDPA: ``le(kv_idx, q_idx)``, possibly and-ed with all-true) is
  dropped instead and SDPA runs with ``is_causal=True``. Any other mask is materialized at
  ``[B or 1, 1 or H/cp, S, S]`` on every rank, as the unsharded model materializes it.
* Positions computed inside the graph outside masks are moved to the rank's shard (heuristic,
  below).
* Nothing else: the loss stays the mean over the LOCAL tokens. Averaging over cp is the runtime's
  job: a loss tangent of 1/cp on every cp rank, parameter gradients summed over the cp group (one
  all-reduce, like DP), and the mean of the cp ranks' losses as the loss. With equal shards and a
  token-mean loss that equals the full-sequence loss and gradients (a loss that is not a mean over
  tokens, e.g. a sum, a per-sequence max, or a mean over the non-padding tokens only, needs a
  different reduction).

Position heuristic (and its limits). Outside masks, a value is treated as "a position" when it
has exactly the local length ``s`` and comes from one of:
  1. ``aten.arange`` with step 1 and ``s`` values (``torch.arange(t)``, also ``arange(k, k + t)``):
     it becomes ``arange(start + r*s, start + (r+1)*s)`` with the same dtype;
  2. ``aten.slice`` with step 1 and ``s`` values of a buffer or lifted constant (possibly after
     dtype casts/clones/unsqueezes/other slices), e.g. RoPE tables ``self.rope_cos[:t]``: it becomes
     ``[start + r*s : start + (r+1)*s]``; a table shorter than ``start + cp*s`` is a ValueError.
Positions passed in as inputs need nothing (the caller shards them with the data). Not detected,
so silently wrong if present: a strided ``arange`` (step != 1) used as positions, a *parameter*
table sliced by length (learned absolute positions ``self.pos[:, :t]``; index it with
``torch.arange(t)`` / ``nn.Embedding`` instead, which is rewritten), and any op other than
attention that mixes tokens along the sequence (cumsum, convolutions over time; attention
written as ``bmm`` over ``[B*H, s, s]`` scores is refused, below). Conversely an unrelated ``arange`` of
length ``s`` or buffer slice of length ``s`` outside a mask (say ``arange(head_dim)`` when
``head_dim == s``) would be shifted: choose another sequence length if that happens. Each
rewrite is logged at INFO.

Errors (ValueError, raised before any communication, naming the node, the user's source line
and why): no attention in the graph at all, q, k or v heads not divisible by cp (query heads
only for a grouped-query SDPA), an attention
output other than the first used by the graph (e.g. the logsumexp), attention whose q/k length is
not the shard length (cross-attention, KV cache), a softmax over ``[.., s, s]`` scores that is
not a region as above (3-d ``bmm`` attention, the probabilities used elsewhere, an op between
the matmuls that is not element-wise), a mask that depends on a parameter or uses an op the
rebuild does not follow (reductions, reshapes that merge dims, ...), a dropout mask passed to
SDPA, positions or tables that cannot be rewritten (above), a group whose size or rank disagrees
with ``cp`` / ``cp_rank``, and a second application. A region found from its score matmul that
cannot be rewritten says "attention found at <where> (q @ k^T .., softmax ..), cannot rewrite
because <why>" (a non-element-wise op between the scores and the softmax, a reduction over the
queries, extra logits not dropped before ``p @ v``, ...), not "no attention".

Dropout inside attention (``dropout_p > 0``) is kept; its random mask is drawn over the head
shard, so it differs from a cp=1 run as any re-sharding does. Reference: DeepSpeed-Ulysses
(arXiv 2309.14509).
"""
from __future__ import annotations

import logging
import math
import operator
from dataclasses import dataclass, field

import torch
import torch.distributed._functional_collectives  # noqa: F401 - registers the collectives' autograd
import torch.fx as fx
from torch._guards import detect_fake_mode

from autopar.collectives import comms

from . import op_semantics
from .captured import CapturedGraph
from .costs import annotate_costs
from .provenance import module_path, op_name, source_of

log = logging.getLogger("autopar")
aten = torch.ops.aten
_c10d = torch.ops._c10d_functional

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


def apply_context_parallel(captured: CapturedGraph, cp: int, cp_rank: int, group) -> CapturedGraph:
    """Rewrite ``captured`` (captured on sequence shard ``cp_rank`` of ``cp``) for Ulysses CP.

    ``group`` is the cp process group (a ProcessGroup, or its registered group name), whose rank
    ``i`` holds sequence shard ``i``. Returns a new CapturedGraph (``captured`` is not changed)
    whose node ``meta["val"]`` and cost annotations are current. ``cp == 1`` returns ``captured``.
    Raises ValueError (before any communication) for what it cannot rewrite; see the module docs.
    """
    if not isinstance(cp, int) or cp < 1:
        raise ValueError(f"autopar: context parallel degree cp must be a positive integer, got {cp!r}")
    if not 0 <= cp_rank < cp:
        raise ValueError(f"autopar: cp_rank {cp_rank} is outside 0..{cp - 1} for cp={cp}")
    if cp == 1:
        return captured
    if "autopar_context_parallel" in captured.gm.meta:
        raise ValueError(f"autopar: context parallelism was already applied to this graph "
                         f"(cp, cp_rank = {captured.gm.meta['autopar_context_parallel']}); apply it once, to a "
                         "fresh capture")
    s = _shard_length(captured)
    captured = captured.copy()  # the analysis only reads it; a ValueError leaves the caller's graph as it was
    plan = _analyze(captured, cp, s, full=cp * s)  # 1. check everything before changing anything
    group_name = _group_name(group, cp, cp_rank)
    gm, graph = captured.gm, captured.gm.graph
    fake_mode = detect_fake_mode([n.meta.get("val") for n in graph.nodes if n.op == "placeholder"])
    assert fake_mode is not None, "captured graphs carry fake tensors in meta['val']"

    # 2. rewrite
    with fake_mode:
        rw = _Rewriter(graph, plan, cp, cp_rank, s, group_name)
        order = {n: i for i, n in enumerate(graph.nodes)}
        for mask in sorted(plan.masks.values(), key=lambda m: order[m.out]):
            if not mask.causal:  # in graph order: copies shared between masks precede every user
                rw.full_mask(mask)
        for att in plan.attentions:
            rw.attention(att)
        rw.erase_dead_masks()
        for node, start in plan.aranges:
            _offset_arange(node, start + cp_rank * s, s)
        for node, start, _table in plan.slices:
            _offset_slice(node, start + cp_rank * s, s)
    graph.lint()
    gm.recompile()
    annotate_costs(gm)
    gm.meta["autopar_context_parallel"] = (cp, cp_rank)
    for node, start in plan.aranges:
        log.info("autopar: cp: %s (arange of %d positions) now starts at %d", node.name, s, start + cp_rank * s)
    for node, start, table in plan.slices:
        log.info("autopar: cp: %s now takes positions %d..%d of %s", node.name, start + cp_rank * s,
                 start + (cp_rank + 1) * s, table)
    for mask in plan.masks.values():
        log.info("autopar: cp: mask %s %s", mask.out.name, "is causal: SDPA runs with is_causal=True" if mask.causal
                 else f"rebuilt for the whole sequence from {cp if _Q in mask.uses else 1} x "
                      f"{cp if _KV in mask.uses else 1} blocks")
    if plan.inputs:
        log.info("autopar: cp: masks read %s by position: all-gathered over the cp group",
                 ", ".join(sorted(n.name for n in plan.inputs)))
    log.info("autopar: context parallel cp=%d rank %d (group %s): %d attention ops on all-to-all (%d SDPA, %d "
             "regions), %d masks rebuilt or made causal, %d position ops offset by %d", cp, cp_rank, group_name,
             len(plan.attentions), sum(a.kind == "sdpa" for a in plan.attentions),
             sum(a.kind == "region" for a in plan.attentions), len(plan.masks),
             len(plan.aranges) + len(plan.slices), cp_rank * s)
    return captured


def context_parallel_blocker(captured: CapturedGraph, cp: int, *, shard: bool = False) -> str | None:
    """Why ``apply_context_parallel`` would refuse this graph at this ``cp`` (its ValueError's
    message), or None if it would rewrite it. Cheap: graph walks only, no copy, no fake tensors,
    no process group (the group is not checked).

    ``captured`` is the graph the planner has, captured at the full sequence length ``S`` (then
    ``S`` must divide by cp), or with ``shard=True`` a capture on one sequence shard (what
    ``apply_context_parallel`` takes; tables must then cover ``cp`` times its length). The
    verdict is structural (heads, masks, attention regions, table lengths), so a full-length
    capture answers for every cp that divides S and the head counts.
    """
    if not isinstance(cp, int) or cp < 1:
        return f"autopar: context parallel degree cp must be a positive integer, got {cp!r}"
    if cp == 1:
        return None
    if "autopar_context_parallel" in captured.gm.meta:
        return "autopar: context parallelism was already applied to this graph"
    try:
        length = _shard_length(captured)
        if not shard and length % cp:
            return (f"autopar: cp={cp} shards the sequence into equal parts, but the sequence length {length} does "
                    f"not divide by {cp}; use a length divisible by {cp} or another cp")
        _analyze(captured, cp, length, full=cp * length if shard else length)
    except ValueError as e:
        return str(e)
    return None


# ---------------------------------------------------------------------------------------------
# analysis: what to rewrite (raises ValueError for what cannot be)


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


def _analyze(captured: CapturedGraph, cp: int, s: int, full: int) -> _Plan:
    """Everything the rewrite needs, or ValueError. ``s``: the captured sequence length; ``full``:
    the length the rewritten graph will attend over (tables must cover it)."""
    graph = captured.gm.graph
    dep = _param_dependent(captured)
    roles = _MaskRoles(captured, s, full, dep)
    attentions, masks = [], {}

    def mask_of(x: fx.Node, consumer: fx.Node, heads: int) -> _Mask | None:
        val = x.meta["val"]
        if x in dep:
            raise _error(x, f"the attention mask/bias {x.name} used by {consumer.name} depends on a parameter (a "
                            "learned bias); context parallelism rebuilds masks from positions, buffers and model "
                            "inputs only. Use cp=1")
        nd = val.dim()
        if nd >= 3 and val.shape[nd - 3] not in (1, heads):
            raise _error(x, f"the attention mask {x.name} has {val.shape[nd - 3]} heads against {heads} query heads")
        seq_dims = [d for d in (-2, -1) if nd >= -d and val.shape[d] == s]
        if not seq_dims:
            if any(val.shape[d] != 1 for d in (-2, -1) if nd >= -d):
                raise _error(x, f"the attention mask {x.name} of shape {tuple(val.shape)} does not broadcast over the "
                                f"{s} x {s} scores")
            return None  # broadcast over the scores: at most a head dim to narrow
        if x not in masks:
            masks[x] = roles.mask(x)
        return masks[x]

    for node in graph.nodes:
        if node.op != "call_function":
            continue
        if node.target in ATTENTION_OPS:
            att = _check_sdpa(node, cp, s)
            for name in _MASK_ARGS:
                if _has_arg(node, name) and isinstance(_arg(node, name), fx.Node):
                    x = _arg(node, name)
                    att.masks.append((node, name, mask_of(x, node, att.heads)))
            attentions.append(att)
        elif node.target in _SOFTMAX:
            val = node.meta["val"]
            square = val.dim() >= 3 and val.shape[-1] == s and val.shape[-2] == s
            if square or (val.dim() == 4 and val.shape[-2] == s and val.shape[-1] > s):  # [.., s, s + k]: sinks?
                att = _find_region(node, cp, s, dep, square=square)
                if att is None:
                    continue
                att.masks = [(c, i, mask_of(_get_loc(c, i), c, att.heads)) for c, i in att.masks]
                attentions.append(att)
    if not attentions:
        raise ValueError(f"autopar: cp={cp}, but the graph has no attention (no scaled_dot_product_attention, no "
                         "matmul -> softmax -> matmul region over the sequence): context parallelism would leave every "
                         "rank attending within its own shard. Use F.scaled_dot_product_attention, or cp=1")
    # causal masks that only SDPA reads as attn_mask: replaced by is_causal
    for m in masks.values():
        m.causal = m.causal and all(a.kind == "sdpa" and w == "attn_mask" for a in attentions
                                    for _c, w, mm in a.masks if mm is m)
    consumers = {(c, w) for a in attentions for c, w, m in a.masks if m is not None}
    for m in masks.values():
        others = [u for u in m.out.users if u.target is not _ASSERT and not any(
            c is u for c, _w in consumers)]
        if others:
            raise _error(m.out, f"the attention mask {m.out.name} is also used by {', '.join(u.name for u in others)}, "
                                "which would see only the local block of it")
    erase = _exclusive(graph, masks, roles.nodes)
    aranges, slices = _find_positions(captured, cp, s, full, skip=erase)
    return _Plan(attentions, masks, roles.memo, roles.inputs_read, roles.state, erase, aranges, slices)


def _param_dependent(captured: CapturedGraph) -> set:
    """Nodes whose value depends on a parameter (activations; masks must not be)."""
    dep = set()
    for node in captured.gm.graph.nodes:
        if node.op == "placeholder":
            if node.name in captured.params:
                dep.add(node)
        elif any(a in dep for a in node.all_input_nodes):
            dep.add(node)
    return dep


def _exclusive(graph: fx.Graph, masks: dict, nodes: set) -> set:
    """Mask subgraph nodes nothing but the masks' attention consumers uses (they die with the rewrite)."""
    out = set()
    for node in reversed(graph.nodes):
        if node in nodes and node.op != "placeholder" and all(
                u in out or u.target is _ASSERT or (node in masks and u not in nodes) for u in node.users):
            out.add(node)
    return out


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
