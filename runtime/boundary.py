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
