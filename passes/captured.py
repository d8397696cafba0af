"""The captured graph as data: one microbatch of model + loss as a functional fx graph, with
where each value lives (``CapturedGraph``; made by passes/capture.py, read and rewritten by the
other passes)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
import torch.fx as fx


@dataclass
class CapturedGraph:
    """One microbatch of model + loss as a functional fx graph, with where each value lives.

    Fields map placeholder / output node *names* to model state:
      params         placeholder -> canonical parameter FQN (first name in model.named_parameters())
      buffers        placeholder -> buffer FQN
      constants      placeholder -> tensor lifted by export that is neither parameter nor buffer
      inputs         placeholder names of the model inputs, in call order
      target         placeholder name of the target, or None when the model returns its loss
      buffer_updates output-value node name -> FQN of the buffer it overwrites after the step
      loss           node name of the scalar loss
      aliases        canonical FQN -> every FQN of that parameter (tied weights)
    """

    gm: fx.GraphModule
    params: dict[str, str]
    buffers: dict[str, str]
    constants: dict[str, torch.Tensor]
    inputs: list[str]
    target: str | None
    buffer_updates: dict[str, str]
    loss: str
    aliases: dict[str, list[str]] = field(default_factory=dict)

    def node(self, name: str) -> fx.Node:
        for n in self.gm.graph.nodes:
            if n.name == name:
                return n
        raise KeyError(name)

    def copy(self) -> "CapturedGraph":
        """The same capture over a copy of the graph (node names and meta kept), for passes that
        return a rewritten capture without changing their input."""
        graph = fx.Graph()
        graph.output(graph.graph_copy(self.gm.graph, {}))
        gm = fx.GraphModule(self.gm, graph, class_name=type(self.gm).__name__)
        gm.meta.update(self.gm.meta)
        return dataclasses.replace(self, gm=gm)

    def summary(self) -> str:
        n_ops = sum(1 for n in self.gm.graph.nodes if n.op == "call_function")
        flops = sum(n.meta.get("autopar_flops", 0) for n in self.gm.graph.nodes)
        return (f"{n_ops} ops, {len(self.params)} parameters, {len(self.buffers)} buffers, "
                f"{len(self.inputs)} inputs, {flops / 1e9:.3f} GFLOP forward per microbatch")
