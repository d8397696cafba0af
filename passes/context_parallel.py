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

import torch
import torch.distributed._functional_collectives  # noqa: F401 - registers the collectives' autograd
import torch.fx as fx
from torch._guards import detect_fake_mode

from .captured import CapturedGraph
from .costs import annotate_costs
from .cp_regions import _find_positions, _find_region, _get_loc, _MaskRoles
from .cp_rewrite import _offset_arange, _offset_slice, _Rewriter
from .cp_rules import (
    _ASSERT,
    _KV,
    _MASK_ARGS,
    _Q,
    _SOFTMAX,
    ATTENTION_OPS,
    _arg,
    _check_sdpa,
    _error,
    _group_name,
    _has_arg,
    _Mask,
    _Plan,
    _shard_length,
)

log = logging.getLogger("autopar")
aten = torch.ops.aten

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
