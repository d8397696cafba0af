"""How an activation crosses a pipeline boundary: what is sent and how it is rebuilt.

A stage input is received into a dense buffer, whatever the layout its producer left it in:
a broadcast view (a causal mask ``[B, 1, S, S]`` expanded over the batch, several elements on
one memory location), a transposed or channels-last tensor, an integer or bool tensor, a 0-dim
tensor. The traced layout of the receiving stage's placeholder decides (both sides read it,
so sender and receiver always agree on the message): dims it broadcasts (stride 0, size > 1)
are sent as one slice and expanded again on arrival, so a broadcast mask costs one slice of
bytes; everything else is sent contiguous and gets the traced strides back at the receiver
(``StageWork.put_inputs``, ``with_strides``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Wire:
    """One boundary tensor on the wire: ``shape`` travels, ``full`` is rebuilt by expanding."""

    shape: tuple[int, ...]
    full: tuple[int, ...]
    dtype: torch.dtype
    broadcast: tuple[int, ...]  # dims sent as one slice

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        """What the sender sends: the slice along the broadcast dims, contiguous."""
        if self.broadcast:
            t = t[tuple(slice(0, 1) if d in self.broadcast else slice(None) for d in range(t.dim()))]
        return t.contiguous()

    def unpack(self, buf: torch.Tensor) -> torch.Tensor:
        """The received tensor in its full shape (a view of ``buf``)."""
        return buf.expand(self.full) if self.broadcast else buf


def wire_of(val: torch.Tensor) -> Wire:
    """The wire format of a tensor traced as ``val`` (a placeholder's fake value)."""
    full = tuple(val.shape)
    broadcast = tuple(d for d, (n, s) in enumerate(zip(full, val.stride())) if s == 0 and n > 1)
    shape = tuple(1 if d in broadcast else n for d, n in enumerate(full))
    return Wire(shape=shape, full=full, dtype=val.dtype, broadcast=broadcast)


def input_wires(stage) -> dict[str, Wire]:
    """name -> Wire of every activation a stage receives (``stage``: a StageGraph)."""
    phs = {n.name: n for n in stage.gm.graph.nodes if n.op == "placeholder"}
    return {name: wire_of(phs[name].meta["val"]) for name in stage.inputs}


# -- what each side of a boundary was built for, checked before the first message --------------

Spec = tuple  # (shape on the wire, dtype name, where the value was made in the user's code)


def _result_nodes(prog) -> dict:
    """A program's result key -> the node it returns (with its traced value in ``meta["val"]``)."""
    out = next(n for n in prog.gm.graph.nodes if n.op == "output")
    return dict(zip(prog.results, out.args[0]))


def _spec(val, source: str, broadcast: tuple[int, ...] = ()) -> Spec:
    shape = tuple(1 if d in broadcast else int(n) for d, n in enumerate(val.shape))
    return shape, str(val.dtype).removeprefix("torch."), source


def sent_activations(prog, wires: dict[str, Wire]) -> dict[str, Spec] | None:
    """name -> what stage ``prog`` (a StageProgram) puts on the wire for each activation it
    sends: its F program's traced result, sliced as the receiver's wire says; None when the
    program carries no traced values."""
    from autopar.passes import keys
    from autopar.passes.provenance import source_of

    nodes = _result_nodes(prog.f)
    stage_out = next(n for n in prog.stage.gm.graph.nodes if n.op == "output").args[0]
    made = dict(zip(prog.stage.outputs, stage_out))  # the captured nodes (with the user's stack)
    out = {}
    for name, w in wires.items():
        node = nodes.get(keys.out(name))
        val = node.meta.get("val") if node is not None else None
        if not isinstance(val, torch.Tensor):
            return None
        out[name] = _spec(val, source_of(made[name]) if name in made else "",
                          w.broadcast if val.dim() == len(w.full) else ())
    return out


def sent_gradients(prog, names: tuple[str, ...]) -> dict[str, Spec] | None:
    """name -> the input gradient stage ``prog`` sends back for each of ``names`` (the previous
    stage's differentiable outputs): its I program's traced result (B's where I has none)."""
    from autopar.passes import keys
    from autopar.passes.provenance import source_of

    out = {}
    for name in names:
        for p in (prog.i, prog.b):
            node = _result_nodes(p).get(keys.gin(name))
            if node is not None:
                break
        val = node.meta.get("val") if node is not None else None
        if not isinstance(val, torch.Tensor):
            return None
        out[name] = _spec(val, source_of(node))
    return out


def expected(specs: dict[str, tuple]) -> dict[str, Spec]:
    """name -> the receiver's Spec from ``{name: (shape, dtype)}`` (its receive buffers)."""
    return {n: (tuple(int(x) for x in shape), str(dt).removeprefix("torch."), "") for n, (shape, dt) in specs.items()}


def _nbytes(spec: Spec) -> int:
    return math.prod(spec[0]) * getattr(torch, spec[1]).itemsize


def mismatches(sends: dict, expects: dict) -> list[str]:
    """Every disagreement between what ranks send and what their peers were built to receive.

    ``sends[rank][(direction, stage)] = {name: Spec}`` (direction "F": stage's activations to
    stage+1; "B": stage's input gradients to stage-1); ``expects[rank][(direction, stage,
    peer)]`` the same for what ``rank`` receives from global rank ``peer``, keyed by the
    sending stage."""
    out = []
    for rank in sorted(expects):
        for (direction, stage, peer), want in sorted(expects[rank].items()):
            got = sends.get(peer, {}).get((direction, stage))
            if got is None:
                continue  # the sender's programs carry no traced values: nothing to compare
            to = stage + 1 if direction == "F" else stage - 1
            what = "activations" if direction == "F" else "input gradients"
            where = f"pipeline boundary stage {stage} -> stage {to} ({what}, rank {peer} -> rank {rank})"
            if list(got) != list(want):
                out.append(f"{where}: rank {peer} sends tensors {list(got)}, rank {rank} expects {list(want)} "
                           "(names and order must agree; every rank continues from rank 0's graph "
                           "(passes/align.py), so the ranks' stage programs differ after it: different "
                           "plans, model code or rewrites per rank)")
                continue
            for name, spec in got.items():
                w = want[name]
                if spec[:2] != w[:2]:
                    made = f"; made at {spec[2]}" if spec[2] else ""
                    out.append(f"{where}: tensor {name!r}: rank {peer} sends {list(spec[0])} {spec[1]} "
                               f"({_nbytes(spec)} B), rank {rank} expects {list(w[0])} {w[1]} ({_nbytes(w)} B){made}")
    return out
