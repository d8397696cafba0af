"""passes/align.py: a capture traced in another order (what a set of strings does under another
Python hash seed) is rebuilt as the reference graph, node for node and name for name, and
computes the same; a capture of other model code is refused by name."""
import pytest
import torch
import torch.nn as nn

from autopar.passes import capture
from autopar.passes.align import align, fingerprints


class _TwoTables(nn.Module):
    """Two tables computed in an order given at construction (Gemma 3 iterates a set of layer
    types), then used in a fixed order."""

    def __init__(self, order=("local", "global"), scale: float = 2.0):
        super().__init__()
        self.order, self.scale = order, scale
        self.lin = nn.Linear(8, 8)
        self.register_buffer("freq", torch.arange(8.0) / 8, persistent=False)

    def forward(self, x):
        tables = {}
        for kind in self.order:
            base = 10.0 if kind == "local" else 1000.0
            tables[kind] = torch.cos(self.freq * base) * self.scale
        h = self.lin(x) * tables["local"]
        return (h + tables["global"]).pow(2).mean()


def _names(cap):
    return [n.name for n in cap.gm.graph.nodes]


def test_a_capture_traced_in_another_order_becomes_the_reference():
    x = torch.randn(4, 8)
    ref = capture(_TwoTables(("local", "global")), (x,))
    other = capture(_TwoTables(("global", "local")), (x,))
    # the same names, other computations under them (``mul`` is freq * 1000 in ``other``): what
    # the ranks disagreed on at the stage boundaries
    assert _names(ref) == _names(other) and fingerprints(ref) != fingerprints(other)
    aligned = align(other, fingerprints(ref))
    assert fingerprints(aligned) == fingerprints(ref) and _names(aligned) == _names(ref)
    assert [str(n.target) for n in aligned.gm.graph.nodes] == [str(n.target) for n in ref.gm.graph.nodes]
    assert (aligned.params, aligned.buffers, aligned.inputs, aligned.loss) == (ref.params, ref.buffers, ref.inputs,
                                                                              ref.loss)
    model = _TwoTables(("global", "local"))  # eager PyTorch computes what the aligned graph does
    with torch.no_grad():
        want = model(x)
        got = aligned.gm(model.lin.weight, model.lin.bias, model.freq, x)[0]
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    assert align(ref, fingerprints(ref)) is ref  # nothing to do: the same object


def test_a_capture_of_other_model_code_is_refused_by_name():
    x = torch.randn(4, 8)
    ref = capture(_TwoTables(scale=2.0), (x,))
    other = capture(_TwoTables(scale=3.0), (x,))
    with pytest.raises(ValueError, match="has no counterpart in this rank's capture: the ranks run different model"):
        align(other, fingerprints(ref))
