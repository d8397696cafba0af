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
* between them, each op follows a rule (passes/tp_rules.py): element-wise ops, reshapes (a sharded dim
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
import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode

from .captured import CapturedGraph
from .tp_ops import VOCAB_CE
from .tp_rules import _SAME, _VIEWS, _argument, _NoRule, _rule, _split_dim, _tensor_args, _val, _where, narrowed

log = logging.getLogger("autopar")
aten = torch.ops.aten


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
