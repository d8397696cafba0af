"""runtime/compiled.py, one program at a time: Inductor's code for an aten graph equals the
graph run by PyTorch op by op (the same aten calls, eagerly), including a result that is a
node of several (``native_layer_norm``'s three, returned whole as F returns it for B) and a
gradient accumulated into a trailing argument; a call with other shapes compiles again (the
log says so) and is right too; a graph that calls a module goes through Dynamo."""
import logging
import operator

import pytest
import torch
import torch.fx as fx

from autopar.passes.program import Program
from autopar.runtime.compiled import _needs_dynamo, compiled_executable


def _program() -> Program:
    """y = layer_norm(x @ w); returns (sum(y), layer_norm's 3 results whole, x @ w)."""
    g = fx.Graph()
    x, w, ln_w = g.placeholder("x"), g.placeholder("w"), g.placeholder("ln_w")
    h = g.call_function(torch.ops.aten.mm.default, (x, w))
    ln = g.call_function(torch.ops.aten.native_layer_norm.default, (h, [4], ln_w, None, 1e-5))
    y = g.call_function(operator.getitem, (ln, 0))
    s = g.call_function(torch.ops.aten.sum.default, (y,))
    g.output((s, ln, h))
    gm = fx.GraphModule(torch.nn.Module(), g)
    return Program(gm=gm, args=("x", "w", "ln_w"), results=("s", "ln", "h"), compiled_as="test F")


def _check(fn, gm, rows: int) -> None:
    torch.manual_seed(rows)
    x, w, ln_w = torch.randn(rows, 3), torch.randn(3, 4), torch.randn(4)
    acc = torch.randn(rows, 4)  # h accumulates into it
    want_s, want_ln, want_h = gm(x, w, ln_w)
    want_acc = acc + want_h
    with torch.no_grad():
        s, ln, h = fn([x, w, ln_w, acc])
    torch.testing.assert_close(s, want_s, rtol=1e-5, atol=1e-5)
    assert isinstance(ln, tuple) and len(ln) == 3
    for got, want in zip(ln, want_ln):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert h is acc  # the accumulator stands for its result
    torch.testing.assert_close(acc, want_acc, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_compiled_program_equals_its_graph_and_recompiles_for_new_shapes(caplog):
    prog = _program()
    assert _needs_dynamo(prog.gm) is None
    fn = compiled_executable(prog, accumulate=(2,))
    with caplog.at_level(logging.INFO, logger="autopar"):
        _check(fn, prog.gm, rows=5)
        first = prog.compile_s
        _check(fn, prog.gm, rows=5)  # the same key: no compile
        assert prog.compile_s == first
        _check(fn, prog.gm, rows=7)  # other shapes: compiled again, right again
    assert prog.compile_s > first
    lines = [r.getMessage() for r in caplog.records if "compiled test F" in r.getMessage()]
    assert len(lines) == 2 and "its first call" in lines[0] and "new argument shapes" in lines[1], lines


def test_a_graph_that_calls_a_module_goes_through_dynamo():
    class Fetch(torch.nn.Module):
        def forward(self, x):
            return x

    root = torch.nn.Module()
    root.fetch = Fetch()
    g = fx.Graph()
    x = g.placeholder("x")
    g.output((g.call_module("fetch", (x,)),))
    assert _needs_dynamo(fx.GraphModule(root, g)) == "call_module 'fetch'"
    assert _needs_dynamo(_program().gm) is None
