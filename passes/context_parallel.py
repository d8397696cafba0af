"""Ulysses context parallelism as a graph pass: attention all-to-all over the sequence shards.

Contract. The graph was captured at the LOCAL sequence length: the caller cut every model input
and the target along dim 1 into ``cp`` equal contiguous shards, and cp rank ``r`` captured with
shard ``r`` (shape ``[mb, s]``, ``s = S / cp``). ``apply_context_parallel`` rewrites that graph
so that it computes, for the rank's ``s`` positions, exactly what the full-sequence model does:

* Attention. Every scaled-dot-product attention node (``aten.scaled_dot_product_attention`` as
  torch.export keeps it, and the backend forms ``_scaled_dot_product_flash_attention_for_cpu``,
  ``_flash_attention``, ``_efficient_attention``, ``_cudnn_attention``,
  ``_fused_attention_overrideable``, ``_attention_math``) becomes
      q, k, v  [B, H, s, D]  --all-to-all-->  [B, H/cp, S, D]   (sequence blocks in rank order)
      the same attention op on the whole sequence (so ``is_causal`` keeps its meaning)
      out [B, H/cp, S, D]   --all-to-all-->  [B, H, s, D]        (same strides as before)
  with ``torch.ops._c10d_functional.all_to_all_single`` + ``wait_tensor``: what
  ``_functional_collectives.all_to_all_single_autograd`` records under make_fx. Its autograd
  formula is registered when ``torch.distributed._functional_collectives`` is imported (this
  module does), so split_backward's joint trace gets the backward all-to-alls for free; they land
  in whichever program computes the gradient through them (I, or W for a stage with no
  differentiable input).
* Positions computed inside the graph are moved to the rank's shard (heuristic, below).
* Nothing else: the loss stays the mean over the LOCAL tokens. Averaging over cp is the runtime's
  job: a loss tangent of 1/cp on every cp rank, parameter gradients summed over the cp group (one
  all-reduce, like DP), and the mean of the cp ranks' losses as the loss. With equal shards and a
  token-mean loss that equals the full-sequence loss and gradients (a loss that is not a mean over
  tokens, e.g. a sum or a per-sequence max, needs a different reduction).

Position heuristic (and its limits). A value is treated as "a position" when it has exactly the
local length ``s`` and comes from one of:
  1. ``aten.arange`` with step 1 and ``s`` values (``torch.arange(t)``, also ``arange(k, k + t)``):
     it becomes ``arange(start + r*s, start + (r+1)*s)`` with the same dtype;
  2. ``aten.slice`` with step 1 and ``s`` values of a buffer or lifted constant (possibly after
     dtype casts/clones/unsqueezes/other slices), e.g. RoPE tables ``self.rope_cos[:t]``: it becomes
     ``[start + r*s : start + (r+1)*s]``; a table shorter than ``start + cp*s`` is a ValueError.
     A buffer sliced to ``s`` along two dims (``self.mask[:t, :t]``, a hand-made causal mask) is a
     ValueError: the rank would only see its diagonal block.
Positions passed in as inputs need nothing (the caller shards them with the data). Not detected,
so silently wrong if present: a strided ``arange`` (step != 1) used as positions, a *parameter*
table sliced by length (learned absolute positions ``self.pos[:, :t]``; index it with
``torch.arange(t)`` / ``nn.Embedding`` instead, which is rewritten), and any other op that mixes
tokens along the sequence: hand-written attention (matmul + softmax), cumsum, convolutions over
time. Conversely an unrelated ``arange`` of length ``s`` or buffer slice of length ``s`` (say
``arange(head_dim)`` when ``head_dim == s``) would be shifted: choose another sequence length if
that happens. Each rewrite is logged at INFO.

Errors (ValueError, raised before the graph is changed): no SDPA in the graph at all, q, k or v
heads not divisible by cp, an explicit attention mask or bias (use ``is_causal=True`` or no mask), an
attention output other than the first used by the graph (e.g. the logsumexp), attention whose q/k
length is not the shard length (cross-attention), positions that cannot be rewritten (above), a
group whose size or rank disagrees with ``cp`` / ``cp_rank``, and a second application.

Dropout inside attention (``dropout_p > 0``) is kept; its random mask is drawn over the head
shard, so it differs from a cp=1 run as any re-sharding does. Reference: DeepSpeed-Ulysses
(arXiv 2309.14509).
"""
from __future__ import annotations

import logging
import math
import operator

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives  # noqa: F401 - registers the collectives' autograd
import torch.fx as fx
from torch._guards import detect_fake_mode

from .capture import CapturedGraph
from .costs import annotate_costs

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
_MASK_ARGS = ("attn_mask", "attn_bias", "dropout_mask")  # tensors over [.., S, S]: not shardable here

_ARANGE = {aten.arange.default, aten.arange.start, aten.arange.start_step}
# ops a position table may pass through between its placeholder and the slice that picks positions
_TABLE_CHAIN = {aten._to_copy.default, aten.clone.default, aten.alias.default, aten.detach.default,
                aten.lift_fresh_copy.default, aten.unsqueeze.default, aten.slice.Tensor}


def apply_context_parallel(captured: CapturedGraph, cp: int, cp_rank: int, group) -> CapturedGraph:
    """Rewrite ``captured`` (captured on sequence shard ``cp_rank`` of ``cp``) for Ulysses CP.

    ``group`` is the cp process group (a ProcessGroup, or its registered group name), whose rank
    ``i`` holds sequence shard ``i``. Returns a new CapturedGraph (``captured`` is not changed)
    whose node ``meta["val"]`` and cost annotations are current. ``cp == 1`` returns ``captured``.
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
    captured = captured.copy()
    gm, graph = captured.gm, captured.gm.graph
    group_name = _group_name(group, cp, cp_rank)
    fake_mode = detect_fake_mode([n.meta.get("val") for n in graph.nodes if n.op == "placeholder"])
    assert fake_mode is not None, "captured graphs carry fake tensors in meta['val']"
    s = _shard_length(captured)

    # 1. check everything before changing anything
    attention = [n for n in graph.nodes if n.op == "call_function" and n.target in ATTENTION_OPS]
    for node in attention:
        _check_attention(node, cp, s)
    aranges, slices = _find_positions(captured, cp, s)
    if not attention:
        raise ValueError(f"autopar: cp={cp}, but the graph has no scaled_dot_product_attention: context parallelism "
                         "rewrites SDPA only, and a hand-written attention (matmul + softmax) would silently attend "
                         "within each rank's shard. Use F.scaled_dot_product_attention(..., is_causal=True), or cp=1")

    # 2. rewrite
    with fake_mode:
        for node in attention:
            _rewrite_attention(graph, node, cp, group_name)
        for node, start in aranges:
            _offset_arange(node, start + cp_rank * s, s)
        for node, start, _table in slices:
            _offset_slice(node, start + cp_rank * s, s)
    graph.lint()
    gm.recompile()
    annotate_costs(gm)
    gm.meta["autopar_context_parallel"] = (cp, cp_rank)
    for node, start in aranges:
        log.info("autopar: cp: %s (arange of %d positions) now starts at %d", node.name, s, start + cp_rank * s)
    for node, start, table in slices:
        log.info("autopar: cp: %s now takes positions %d..%d of %s", node.name, start + cp_rank * s,
                 start + (cp_rank + 1) * s, table)
    log.info("autopar: context parallel cp=%d rank %d (group %s): %d attention ops on all-to-all, "
             "%d position ops offset by %d", cp, cp_rank, group_name, len(attention), len(aranges) + len(slices),
             cp_rank * s)
    return captured


# ---------------------------------------------------------------------------------------------
# checks


def _group_name(group, cp: int, cp_rank: int) -> str:
    if isinstance(group, str):
        pg = dist.distributed_c10d._resolve_process_group(group)
    elif isinstance(group, dist.ProcessGroup):
        pg = group
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


def _where(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack")
    path = list(stack.values())[-1][0] if stack else ""
    path = path.removeprefix("model.") if path != "model" else ""
    return f"{node.name} ({path})" if path else node.name


def _check_attention(node: fx.Node, cp: int, s: int) -> None:
    op = node.target._schema.name.split("::")[-1]
    what = f"attention {_where(node)}" + ("" if node.name.startswith(op) else f" ({op})")
    for name in _MASK_ARGS:
        if _has_arg(node, name) and _arg(node, name) is not None:
            raise ValueError(f"autopar: {what} has an explicit {name}; context parallelism shards the sequence and "
                             "cannot shard an [S, S] mask. Use is_causal=True or no mask (padding masks: drop them "
                             "or use cp=1)")
    q, k, v = (a.meta["val"] for a in node.args[:3])
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"autopar: {what} takes q/k/v of shapes {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}; context parallelism needs [batch, heads, seq, head_dim]")
    if q.shape[2] != s or k.shape[2] != s or v.shape[2] != s:
        raise ValueError(f"autopar: {what} attends {q.shape[2]} queries over {k.shape[2]} keys, but the sequence "
                         f"shard is {s} long; context parallelism rewrites self-attention over the sharded sequence "
                         "only (no cross-attention, no KV cache). Use cp=1")
    hq, hk, hv = q.shape[1], k.shape[1], v.shape[1]
    if hq % cp or hk % cp or hv % cp:
        g = math.gcd(hq, hk, hv)
        fix = f"use a cp that divides {g}" if g > 1 else "use cp=1"
        if hq % cp == 0:
            fix += f", or repeat the k/v heads to {hq} (repeat_interleave) before attention"
        raise ValueError(f"autopar: {what} has {hq} query heads and {hk}/{hv} key/value heads; cp={cp} must divide "
                         f"every head count (Ulysses gives each cp rank H/cp heads): {fix}")
    if isinstance(node.meta["val"], torch.Tensor):
        return
    returns = node.target._schema.returns
    for user in node.users:
        if user.target is not operator.getitem:
            raise ValueError(f"autopar: {what}: its output tuple is used as a whole by {user.name}")
        i = user.args[1]
        if i != 0 and user.users:
            raise ValueError(f"autopar: {what}: output {i} ({returns[i].name or 'unnamed'}) is used by "
                             f"{', '.join(u.name for u in user.users)}; context parallelism can only rewrite the "
                             "attention output (output 0): the others would cover the full sequence of H/cp heads. "
                             "Use F.scaled_dot_product_attention and its output only, or cp=1")


def _find_positions(captured: CapturedGraph, cp: int, s: int):
    """(arange node, start) and (slice node, start, table name) that pick the local positions."""
    graph = captured.gm.graph
    state = set(captured.buffers) | set(captured.constants)
    aranges, slices = [], []
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        val = node.meta.get("val")
        if node.target in _ARANGE:
            start = _arg(node, "start") if _has_arg(node, "start") else 0
            step = _arg(node, "step") if _has_arg(node, "step") else 1
            if step == 1 and val.numel() == s and val.dim() == 1:
                if start != int(start):
                    raise ValueError(f"autopar: {_where(node)} is arange({start}, ...) with {s} values, the sequence "
                                     "shard length; context parallelism can only offset integer starts. Pass the "
                                     "positions as a model input (sharded with the data) or use cp=1")
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
                raise ValueError(f"autopar: {table.name} is sliced to the sequence shard length {s} along two "
                                 f"dims ({_where(node)}): that looks like an [S, S] attention mask, which context "
                                 "parallelism cannot shard (each rank would see its diagonal block only). Use "
                                 "F.scaled_dot_product_attention(..., is_causal=True) or cp=1")
            start = _arg(node, "start")
            start = 0 if start is None else start
            if start < 0:
                start += src_val.shape[dim]
            if start + cp * s > src_val.shape[dim]:
                raise ValueError(f"autopar: {_where(node)} takes positions {start}..{start + s} of {table.name} "
                                 f"(length {src_val.shape[dim]} along dim {dim}); with cp={cp} the full sequence "
                                 f"needs {start}..{start + cp * s}. Make the table at least {start + cp * s} long "
                                 f"(max sequence length >= {cp * s}) or use cp=1")
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


def _rewrite_attention(graph: fx.Graph, node: fx.Node, cp: int, group_name: str) -> None:
    old_val = node.meta["val"]
    out_val = old_val if isinstance(old_val, torch.Tensor) else old_val[0]
    converted: dict[fx.Node, fx.Node] = {}
    with graph.inserting_before(node):
        for x in node.args[:3]:
            if x not in converted:  # self-attention may pass one tensor as q, k and v
                converted[x] = _seq_to_heads(graph, x, cp, group_name, node)
    node.args = tuple(converted[x] for x in node.args[:3]) + tuple(node.args[3:])
    vals = fx.node.map_arg(node.args, lambda a: a.meta["val"])
    kvals = fx.node.map_arg(node.kwargs, lambda a: a.meta["val"])
    node.meta["val"] = node.target(*vals, **kvals)
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
