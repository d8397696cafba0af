"""ZeRO-3 as a graph pass: a stage's F/I/W/B read streamed parameters from gather buffers.

``stream_parameters(prog, layout, hooks)`` returns a new StageProgram (its input is left as it
is) whose programs no longer take a streamed parameter as an argument. Instead each program
calls ``hooks.fetch(group, next_group)`` before the first use of a group's parameters (it
returns the group's whole values, in the layout's order, from one of two alternating gather
buffers, and may start gathering ``next_group``, the program's next group, into the other) and
``hooks.release(group)`` after the last use, including uses through views. The caller's
``hooks`` (runtime/sharded.ShardedParameters) does the communication; this pass only places
the calls.

A value F saves for I (or I for W) that is only a view of a streamed parameter (``t(weight)``
for a linear's input gradient) would alias a buffer that is overwritten meanwhile: the
consumer recomputes the view from the fetched parameter instead, and the producer stops
returning it.
"""
from __future__ import annotations

import operator
import re

import torch
import torch.fx as fx
import torch.nn as nn

from autopar.passes.zero_layout import ZeroLayout

from . import keys
from .program import Program, StageProgram

_VIEW_OPS_WITHOUT_ALIAS_SCHEMA = {torch.ops.aten._unsafe_view.default}


class _Fetch(nn.Module):
    def __init__(self, hooks, name: str, next_name: str | None):
        super().__init__()
        self.hooks, self.group, self.next = hooks, name, next_name

    @torch.compiler.disable  # communication the runtime drives: a compiled program (Plan.compile) calls it as is
    def forward(self):
        return tuple(self.hooks.fetch(self.group, self.next))


class _Release(nn.Module):
    def __init__(self, hooks, name: str):
        super().__init__()
        self.hooks, self.group = hooks, name

    @torch.compiler.disable
    def forward(self):
        self.hooks.release(self.group)


def stream_parameters(prog: StageProgram, layout: ZeroLayout, hooks) -> StageProgram:
    """The stage's programs with streamed parameters fetched through ``hooks`` (see the module
    docstring); ``prog`` is not changed."""
    group_of = {keys.param(f): g for g in layout.groups if g.streamed for f in g.fqns}
    programs = {name: _copy(getattr(prog, name)) for name in ("f", "i", "w", "b")}
    # 1. saved values that are views of streamed parameters: recompute the view in the consumer
    for producer, consumers in (("f", ("i", "w", "b")), ("i", ("w",))):
        chains = _param_view_results(programs[producer], group_of)
        for c in consumers:
            programs[c] = _rematerialize(programs[c], chains)
    needed = {k for c in ("i", "w", "b") for k in programs[c].args}
    for producer in ("f", "i"):
        programs[producer] = _drop_results(programs[producer],
                                           lambda k: keys.is_kind(k, keys.SAVED) and k not in needed)
    # 2. parameter placeholders -> fetch from the alternating buffers
    for name, p in programs.items():
        programs[name] = _stream(p, group_of, hooks, f"stage{prog.stage.index}_{name.upper()}")
    return prog.with_programs(**programs)


def _copy(p: Program) -> Program:
    """A Program over a fresh GraphModule with a copy of p's graph (the pass edits the copy)."""
    graph = fx.Graph()
    out = graph.graph_copy(p.gm.graph, {})
    graph.output(out)
    return Program(fx.GraphModule(p.gm, graph, class_name=type(p.gm).__name__), p.args, p.results, p.flops)


def _is_alias(n: fx.Node) -> bool:
    """Does n's result alias its first argument (a view op)?"""
    if n.op != "call_function" or not n.args or not isinstance(n.args[0], fx.Node):
        return False
    if n.target in _VIEW_OPS_WITHOUT_ALIAS_SCHEMA:
        return True
    schema = getattr(n.target, "_schema", None)
    if schema is None or len(schema.returns) != 1 or not schema.arguments:
        return False
    ret, arg = schema.returns[0].alias_info, schema.arguments[0].alias_info
    return ret is not None and arg is not None and not ret.is_write


def _placeholders(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "placeholder"]


def _param_view_results(p: Program, streamed: dict) -> dict[str, tuple[str, list[fx.Node]]]:
    """Result key -> (param key, the view nodes from the parameter to the result, in order)."""
    key_of = dict(zip(_placeholders(p.gm), p.args))
    out_node = next(n for n in p.gm.graph.nodes if n.op == "output")
    found = {}
    for key, node in zip(p.results, out_node.args[0]):
        chain = []
        while isinstance(node, fx.Node) and _is_alias(node):
            chain.append(node)
            node = node.args[0]
        if isinstance(node, fx.Node) and node.op == "placeholder" and key_of.get(node) in streamed:
            found[key] = (key_of[node], chain[::-1])
    return found


def _rematerialize(p: Program, chains: dict) -> Program:
    if not any(k in chains for k in p.args):
        return p
    graph = p.gm.graph
    args = list(p.args)
    for key in [k for k in p.args if k in chains]:
        node_of = dict(zip(args, _placeholders(p.gm)))
        ph = node_of[key]
        pkey, chain = chains[key]
        src = node_of.get(pkey)
        if src is None:
            with graph.inserting_after(_placeholders(p.gm)[-1]):
                src = graph.placeholder(_safe(pkey))
            src.meta = dict(chain[0].args[0].meta) if chain else dict(ph.meta)
            args.append(pkey)
        if ph.users:
            first_user = min(ph.users, key=_order(graph).__getitem__)
            value = src
            with graph.inserting_before(first_user):
                for v in chain:
                    value = graph.call_function(v.target, (value, *v.args[1:]), dict(v.kwargs))
                    value.meta = dict(v.meta)
            ph.replace_all_uses_with(value)
        graph.erase_node(ph)
        args.remove(key)
    return _rebuild(p, tuple(args), p.results)


def _drop_results(p: Program, drop) -> Program:
    out = next(n for n in p.gm.graph.nodes if n.op == "output")
    keep = [(k, v) for k, v in zip(p.results, out.args[0]) if not drop(k)]
    if len(keep) == len(p.results):
        return p
    out.args = (tuple(v for _, v in keep),)
    p.gm.graph.eliminate_dead_code()
    return _rebuild(p, p.args, tuple(k for k, _ in keep))


def _stream(p: Program, group_of: dict, hooks, tag: str) -> Program:
    graph = p.gm.graph
    order = _order(graph)
    by_group: dict[str, list[tuple[fx.Node, str]]] = {}
    for ph, key in zip(_placeholders(p.gm), p.args):
        if key in group_of and ph.users:
            by_group.setdefault(group_of[key].name, []).append((ph, key))
    if not by_group:
        return p
    spans = {}
    for name, phs in by_group.items():
        closure = _alias_closure([ph for ph, _ in phs])
        users = [u for n in closure for u in n.users]
        spans[name] = (min(order[u] for u in users), max(order[u] for u in users))
    sequence = sorted(spans, key=lambda nm: spans[nm][0])
    groups = {g.name: g for g in group_of.values()}
    nodes = list(graph.nodes)
    args = list(p.args)
    for i, name in enumerate(sequence):
        g = groups[name]
        first, last = nodes[spans[name][0]], nodes[spans[name][1]]
        mod = _safe(f"zero_fetch_{name}")
        p.gm.add_submodule(mod, _Fetch(hooks, name, sequence[i + 1] if i + 1 < len(sequence) else None))
        with graph.inserting_before(first):
            fetched = graph.call_module(mod, ())
            for ph, key in by_group[name]:
                item = graph.call_function(operator.getitem, (fetched, g.fqns.index(keys.name_of(key, keys.PARAM))))
                item.meta = dict(ph.meta)
                ph.replace_all_uses_with(item)
        rel = _safe(f"zero_release_{name}")
        p.gm.add_submodule(rel, _Release(hooks, name))
        if last.op == "output":
            with graph.inserting_before(last):
                graph.call_module(rel, ())
        else:
            with graph.inserting_after(last):
                graph.call_module(rel, ())
        for ph, key in by_group[name]:
            graph.erase_node(ph)
            args.remove(key)
    out = _rebuild(p, tuple(args), p.results)
    for result, node in zip(out.results, next(n for n in out.gm.graph.nodes if n.op == "output").args[0]):
        if isinstance(node, fx.Node) and node.op == "call_function" and node.target is operator.getitem \
                and isinstance(node.args[0], fx.Node) and node.args[0].op == "call_module":
            raise AssertionError(f"{tag}: result {result} is a streamed parameter itself")
    return out


def _alias_closure(roots: list[fx.Node]) -> set[fx.Node]:
    seen, todo = set(roots), list(roots)
    while todo:
        n = todo.pop()
        for u in n.users:
            if u not in seen and _is_alias(u) and u.args[0] is n:
                seen.add(u)
                todo.append(u)
    return seen


def _order(graph: fx.Graph) -> dict[fx.Node, int]:
    return {n: i for i, n in enumerate(graph.nodes)}


def _safe(name: str) -> str:
    return re.sub(r"\W", "_", name)


def _rebuild(p: Program, args: tuple, results: tuple) -> Program:
    """p (whose graph this pass owns: a copy) with new argument and result keys."""
    p.gm.graph.lint()
    p.gm.recompile()
    return Program(p.gm, args, results, p.flops)
