"""Make every rank's capture the same graph: one node order and one set of names, taken from rank 0.

Model code that iterates over a ``set`` of strings (transformers' Gemma 3 builds its local and
global RoPE tables that way) traces its ops in an order that depends on the process's Python
hash seed, and export names the nodes in trace order (``cos`` on one rank is ``cos_1`` on
another). The graphs are the same computation, but the stage cuts (positions in the node
order) and the values crossing them (node names) differ, and the pipeline ranks would disagree
on what crosses a boundary. torchrun and cluster launchers give every process its own seed.

``fingerprints(captured)`` names each node by what it computes, independent of trace order and
of hashing: its op and constant arguments, its inputs' fingerprints, and for placeholders the
state or input they stand for (a digest, never Python's ``hash``; process-group names and the
build-local handles autopar's own ops take read as one word). The build broadcasts global rank
0's ``[(fingerprint, name)]`` to every rank (one collective, collectives/comms.py): pipeline ranks
must agree on every stage boundary, tensor- and context-parallel ranks on the order of their
collectives, data-parallel replicas on each stage's parameter order (ZeRO's flat layouts); and
``align(captured, reference)``
returns the capture rebuilt in that node order under those names (the graph of rank 0), or the
capture itself when it already is. A rank whose fingerprints differ from rank 0's (different
model code or inputs per rank) gets a ValueError naming the first node that has no match.
"""
from __future__ import annotations

import dataclasses
import hashlib

import torch
import torch.fx as fx

from .captured import CapturedGraph


def fingerprints(captured: CapturedGraph, group_names: frozenset[str] = frozenset()) -> list[tuple[str, str]]:
    """``[(fingerprint, node name)]`` in the graph's order. ``group_names``: process-group names
    an op may take as an argument (a functional collective's group): each rank of a pipeline
    holds its own tensor-, expert- and data-parallel groups, so they read as one word."""
    role = {**{n: f"param:{f}" for n, f in captured.params.items()},
            **{n: f"buffer:{f}" for n, f in captured.buffers.items()},
            **{n: f"input:{i}" for i, n in enumerate(captured.inputs)}}
    if captured.target is not None:
        role[captured.target] = "target"
    for name, t in captured.constants.items():
        role[name] = "constant:" + _shape_text(t)  # shape and dtype: contents may differ per rank (cp, tp)
    prints: dict[fx.Node, str] = {}
    out = []
    for node in captured.gm.graph.nodes:
        if node.op == "placeholder":
            text = role.get(node.name, f"placeholder:{node.name}")
        elif node.op == "get_attr":
            value = getattr(captured.gm, node.target)
            text = "get_attr:" + (_shape_text(value) if isinstance(value, torch.Tensor) else type(value).__name__)
        else:
            args = fx.node.map_arg((node.args, node.kwargs), lambda a: _Ref(prints[a]))
            if getattr(node.target, "namespace", None) == "autopar":
                # autopar's own ops take build-local handles beside their tensors (an experts
                # module's random key, a group's name): only their tensor inputs say what they are
                args = _only_refs(args)
            text = f"{node.op}:{_target_name(node.target)}:{_describe(args, group_names)}"
        digest = hashlib.sha1(text.encode()).hexdigest()
        prints[node] = digest
        out.append((digest, node.name))
    return out


def align(captured: CapturedGraph, reference: list[tuple[str, str]],
          group_names: frozenset[str] = frozenset()) -> CapturedGraph:
    """``captured`` as the graph ``reference`` describes (rank 0's ``fingerprints``): its nodes in
    that order under those names. The same capture when it already is that graph."""
    mine = fingerprints(captured, group_names)
    if mine == reference:
        return captured
    by_print: dict[str, list[fx.Node]] = {}
    nodes = list(captured.gm.graph.nodes)
    for node, (digest, _name) in zip(nodes, mine):
        by_print.setdefault(digest, []).append(node)
    if len(mine) != len(reference):
        raise ValueError(f"autopar: this rank traced {len(mine)} graph nodes, rank 0 traced {len(reference)}: the "
                         "ranks run different model code or inputs (every rank must build the same model and pass the "
                         "same global batch shapes)")
    order: list[tuple[fx.Node, str]] = []
    for digest, name in reference:
        candidates = by_print.get(digest)
        if not candidates:
            raise ValueError(f"autopar: rank 0's graph node {name!r} has no counterpart in this rank's capture: the "
                             "ranks run different model code or inputs (every rank must build the same model and "
                             "pass the same global batch shapes)")
        order.append((candidates.pop(0), name))
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    digest_of = {node: digest for node, (digest, _name) in zip(nodes, mine)}
    placed: dict[str, fx.Node] = {}  # fingerprint -> a copy made for it

    def arg(a: fx.Node) -> fx.Node:
        # Two nodes with one fingerprint compute one value (the same op on the same inputs, e.g.
        # a cast made once per RoPE table): rank 0's order may reach this node's input under the
        # other one's slot first, and either copy serves.
        return env[a] if a in env else placed[digest_of[a]]

    for node, name in order:  # made under rank 0's name (a graph never frees a name once used)
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), arg)
        new = graph.create_node(node.op, node.target, args, kwargs, name=name, type_expr=node.type)
        new.meta = dict(node.meta)
        assert new.name == name, (new.name, name)
        env[node] = new
        placed.setdefault(digest_of[node], new)
    graph.lint()
    gm = fx.GraphModule(captured.gm, graph, class_name=type(captured.gm).__name__)
    gm.meta.update(captured.gm.meta)
    renamed = {node.name: name for node, name in order}
    return dataclasses.replace(
        captured, gm=gm,
        params={renamed[n]: f for n, f in captured.params.items()},
        buffers={renamed[n]: f for n, f in captured.buffers.items()},
        constants={renamed[n]: t for n, t in captured.constants.items()},
        inputs=[renamed[n] for n in captured.inputs],
        target=renamed[captured.target] if captured.target is not None else None,
        buffer_updates={renamed[n]: f for n, f in captured.buffer_updates.items()},
        loss=renamed[captured.loss])


class _Ref:
    """An input node inside a fingerprint's argument text."""

    def __init__(self, digest: str):
        self.digest = digest

    def __repr__(self) -> str:
        return f"<{self.digest}>"


def _only_refs(value):
    if isinstance(value, (list, tuple)):
        return type(value)(_only_refs(v) for v in value)
    if isinstance(value, dict):
        return {k: _only_refs(v) for k, v in value.items()}
    return value if isinstance(value, _Ref) else "*"


def _target_name(target) -> str:
    if isinstance(target, str):
        return target
    name = getattr(target, "__qualname__", None) or getattr(target, "__name__", None) or str(target)
    return f"{getattr(target, '__module__', '')}.{name}:{target}"


def _describe(value, group_names: frozenset[str] = frozenset()) -> str:
    """Deterministic text of an argument structure (no ids, no hash-ordered containers)."""
    if isinstance(value, (list, tuple)):
        inner = ",".join(_describe(v, group_names) for v in value)
        return f"[{inner}]" if isinstance(value, list) else f"({inner})"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}={_describe(value[k], group_names)}" for k in sorted(value)) + "}"
    if isinstance(value, torch.Tensor):
        return _shape_text(value)
    if isinstance(value, str) and value in group_names:
        return "<group>"
    return repr(value)


def _shape_text(t: torch.Tensor) -> str:
    return f"{tuple(t.shape)}:{t.dtype}"


__all__ = ["fingerprints", "align"]
