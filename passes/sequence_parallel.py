"""Sequence parallelism on a tensor-parallel graph: what tp ranks would hold alike is cut along
the tokens instead (Megatron's sequence parallelism, found in the graph).

Runs on the graph ``apply_tensor_parallel`` made. There, the values between a row linear's sum
and the next column linear (the residual stream, norms, biases, element-wise ops) are replicated:
every tp rank computes and keeps the same ``[B, S, H]``. Here they are *token-sharded*: rank r
holds block r of ``tp`` contiguous blocks of one token dim (the leading dim tp divides: the
sequence, or the batch when tp divides it), and

* a row linear's sum ``tp_reduce`` (all-reduce) becomes ``sp_reduce_scatter`` (forward:
  reduce-scatter along the token dim; backward: all-gather of the gradient);
* a column linear's input copy ``tp_copy`` (forward identity, backward all-reduce) becomes
  ``sp_all_gather`` (forward: all-gather; backward: reduce-scatter of the input's gradient);
* token-sharded values follow the tensor-parallel pass's rule table (``_rule``: element-wise ops,
  norms over the hidden dims, views that keep the token block whole, ...);
* a replicated value read along the token dim by a token-sharded element-wise op (the embedding
  output added to the first layer's residual) is cut to the rank's block (``sp_split``: forward
  narrow, backward all-gather of its gradient);
* a replicated parameter (or activation) broadcast over the tokens (a norm's weight, a row's
  bias) gets ``tp_copy``: each rank's gradient is its tokens' part, summed over tp;
* a token-sharded value that reaches an op without a rule (the LM head's linear, dropout, the
  loss, the graph's output) is gathered whole first (``sp_gather``: forward all-gather,
  backward narrow to the rank's block: the replicated consumers compute the same gradient on
  every rank). A row sum all of whose readers would gather at once stays an all-reduce.

Bytes: a reduce-scatter plus an all-gather move what one all-reduce moves, so the collectives
cost the same; what changes is memory: the token-sharded regions' saved activations, and a
pipeline stage boundary inside one, are 1/tp. The all-gathered column input is what the column
linears read for their weight gradients: F keeps only the rank's block and I all-gathers it again
(split_backward._regather_column_inputs, as Megatron-LM does), so W, which reads what I gathered,
still never communicates (zero-bubble schedules move W into bubbles; a W that waits on a
collective would not fill them). Cost: one more all-gather per column input and microbatch in I;
saving: ``[B, S, H] (1 - 1/tp)`` per column input (two per transformer layer) from F to I.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode

from .captured import CapturedGraph
from .tensor_parallel import graded, localize, new_node, refresh_val
from .tp_ops import ALL_GATHER, COPY, GATHER, REDUCE, REDUCE_SCATTER, SPLIT
from .tp_rules import _NoRule, _rule, _tensor_args, _val, _where, is_elementwise, replicated_reads

log = logging.getLogger("autopar")


# -- the analysis ---------------------------------------------------------------------------------------------------


def token_dim(val: torch.Tensor, tp: int) -> int | None:
    """The dim a row's sum is scattered along: the leading one tp divides, before the last
    (hidden) dim; None when there is none."""
    return next((d for d in range(val.dim() - 1) if val.shape[d] % tp == 0 and val.shape[d] >= tp), None)


@dataclass
class Placement:
    dims: dict       # node -> token dim (int; a tuple for tuple results)
    seeds: dict      # row sum -> token dim
    sources: dict    # replicated value cut to the rank's block where it is made -> its dim
    splits: dict     # node -> [(replicated input, its dim)] cut to the rank's block for that node only
    gathers: dict    # node -> [token-sharded inputs] gathered whole before it
    gathered: set    # column input copies that become all-gathers


def _place(plan: Placement, node: fx.Node, tp: int) -> None:
    """The placement of one node from its inputs': token-sharded by a rule, or replicated (its
    token-sharded inputs gathered first; a column's input copy becomes an all-gather)."""
    dims = plan.dims
    sharded = [a for a in _tensor_args(node) if a in dims]
    if not sharded:
        return
    if node.target is COPY:  # a column's input
        plan.gathered.add(node)
        return
    try:
        if node.op == "output":
            raise _NoRule("the graph's output")
        if is_elementwise(node):
            cut = replicated_reads(node, dims)
            d = _rule(node, {**dims, **dict(cut)}, tp)
            if cut:
                plan.splits[node] = cut
        else:
            d = _rule(node, dims, tp)
    except _NoRule as e:
        log.debug("autopar: sequence parallel: %s reads whole values: %s", _where(node), e)
        plan.gathers[node] = sharded
        return
    if d is not None:
        dims[node] = d


def _propagate(graph: fx.Graph, seeds: dict, sources: dict, tp: int) -> Placement:
    plan = Placement({}, dict(seeds), dict(sources), {}, {}, set())
    for node in graph.nodes:
        if node in seeds:
            plan.dims[node] = seeds[node]
            continue
        if node.op in ("call_function", "output"):
            _place(plan, node, tp)
        if node in sources:
            plan.dims[node] = sources[node]
    return plan


def placement(graph: fx.Graph, tp: int) -> Placement:
    """Seeds at every row sum with a token dim. A replicated value some token-sharded op cuts
    (the embedding output, at the first residual add) is cut where it is made instead, so its
    other readers (the first layer's norm) run on the rank's tokens too, unless one of them
    would then gather it. A seed all of whose readers gather it at once stays an all-reduce. The
    analysis runs again after each change."""
    seeds = {n: d for n in graph.nodes if n.target is REDUCE and (d := token_dim(_val(n), tp)) is not None}
    sources: dict = {}
    refused: set = set()
    while True:
        plan = _propagate(graph, seeds, sources, tp)
        bad = {x for x in sources if any(x in plan.gathers.get(u, ()) for u in x.users)}
        if bad:
            refused |= bad
            sources = {x: d for x, d in sources.items() if x not in bad}
            continue
        idle = {s for s in seeds if all(s in plan.gathers.get(u, ()) for u in s.users)}
        new = {a: d for cut in plan.splits.values() for a, d in cut if a not in refused and a not in sources}
        if not idle and not new:
            return plan
        seeds = {s: d for s, d in seeds.items() if s not in idle}
        sources.update(new)


# -- the rewrite ----------------------------------------------------------------------------------------------------


@dataclass
class SequenceParallelResult:
    captured: CapturedGraph
    scattered: int   # row sums that became reduce-scatters
    gathered: int    # column inputs that became all-gathers
    gathers: int     # token-sharded values gathered whole for replicated readers
    kept: int        # row sums left as all-reduces


def apply_sequence_parallel(captured: CapturedGraph, tp: int, group) -> SequenceParallelResult:
    """A new capture whose token-sharded regions hold this tp rank's tokens only (the input
    capture, a tensor-parallel one, is not changed)."""
    group_name = group if isinstance(group, str) else group.group_name
    out = captured.copy()
    graph = out.gm.graph
    plan = placement(graph, tp)
    dims = plan.dims
    graded_values = graded(out)
    fake_mode = detect_fake_mode([n.meta["val"] for n in graph.nodes if n.op == "placeholder"])
    made: dict = {}

    def wrap(target, x: fx.Node, d: int, before: fx.Node) -> fx.Node:
        key = (target, x, d)
        if key not in made:  # one per value and dim, before its first reader
            with graph.inserting_before(before):
                made[key] = new_node(graph, target, (x, group_name) if target is COPY else (x, group_name, d, tp),
                                     before)
        return made[key]

    with fake_mode:
        for node in list(graph.nodes):
            for a in plan.gathers.get(node, ()):  # (also a source's own token-sharded inputs)
                node.replace_input_with(a, wrap(GATHER, a, dims[a], node))
            if node in plan.sources:  # cut where it is made: every reader reads the rank's block
                users = list(node.users)
                cut = wrap(SPLIT, node, plan.sources[node], node.next)
                for u in users:
                    u.replace_input_with(node, cut)
                continue
            if node in plan.seeds:
                node.target, node.args = REDUCE_SCATTER, (node.args[0], group_name, plan.seeds[node], tp)
                refresh_val(node)
                continue
            if node in plan.gathered:
                node.target, node.args = ALL_GATHER, (node.args[0], group_name, dims[node.args[0]], tp)
                refresh_val(node)
                continue
            if node not in dims or node.op != "call_function":
                continue
            cut = dict(plan.splits.get(node, ()))
            for a in _tensor_args(node):
                if a in cut:
                    node.replace_input_with(a, wrap(SPLIT, a, cut[a], node))
                elif a not in dims and a in graded_values:  # broadcast over the tokens: a partial gradient
                    node.replace_input_with(a, wrap(COPY, a, None, node))
            localize(node, dims[node], tp)
    graph.lint()
    out.gm.recompile()
    return SequenceParallelResult(out, len(plan.seeds), len(plan.gathered), sum(k[0] is GATHER for k in made),
                                  sum(1 for n in graph.nodes if n.target is REDUCE))

