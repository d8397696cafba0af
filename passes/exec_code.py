"""Compile a stage program (F/I/W/B GraphModule) into the function the runtime calls.

The programs are small-op graphs: a block of a small transformer is about 40 aten calls, and at
the microbatch sizes pipelines run, Python dispatch is a visible share of their time. FX's code
reaches every op as ``torch.ops.aten.mm.default(...)``, four attribute lookups plus
``OpOverload.__call__`` (about 5 us a call on the CI VM, of which 2.6 us are the lookups).
This module runs the same graph, value for value, with less of that:

* the boxed calling convention: the function takes its arguments as one list and clears it,
  so the runtime can hand over the microbatch's saved tensors and each is freed right after
  its last use inside the program, as autograd frees saved tensors during a backward;
* peephole on a copy of the graph (the program's own GraphModule, the one ``pm.dump`` prints
  and the analyses read, is left as it is):
  - ``detach(x)`` -> ``x``: the programs run under ``no_grad``, where it only makes an alias;
  - ``t(t(x))`` -> ``x`` and ``view(view(x, a), b)`` -> ``view(x, b)`` (the linear backward
    transposes weight gradients twice; decomposed matmuls reshape in chains);
  - a norm/conv backward that ``split_backward`` cut into an input-grad call and a weight-grad
    call, when both land in the same program (the fused B), becomes one call again, as eager
    runs it;
  a result is never replaced by one of the program's arguments (its callers keep and
  accumulate into results);
* every ``torch.ops.<ns>.<op>.<overload>`` is bound once as a global of the generated code, to
  the overload's C++ entry point (what ``OpOverload.__call__`` calls);
* optionally (``accumulate``), weight gradients are added into given tensors in place, a
  matmul's inside the GEMM (``addmm_``): gradient accumulation over microbatches without a
  separate pass over the gradient's memory (runtime/stage_work.py passes every ``.grad``,
  zeroed at the first microbatch of a step); the chunked cross-entropy's head gradient is
  added in place by ``linear_ce_grad_weight_into`` (autopar/linear_ce.py), at any dtype.

On examples/gpt at the pipeline benchmarks' microbatch (128 tokens, d_model 128) this takes
0.6-1.1 ms (7-11%) off each F and B call, and the fused accumulation another 3-7% off B;
large ops are unaffected.
"""
from __future__ import annotations

import itertools
import linecache
import operator
import re
from typing import Callable

import torch
import torch.fx as fx

from autopar import linear_ce

from .split_backward import _MASKED_BACKWARD as _MASKED  # op -> index of its output_mask argument

aten = torch.ops.aten

_OP_REF = re.compile(r"\btorch\.ops\.(\w+)\.(\w+)\.(\w+)\b")
_counter = itertools.count()


class _BoxedCodeGen(fx.graph.CodeGen):
    """``forward(self, args)``: unpacks the list and clears it, so that an argument nobody else
    holds is freed at its last use inside the program (the ``x = None`` lines FX writes),
    not when the call returns."""

    def gen_fn_def(self, free_vars, maybe_return_annotation, **kwargs):
        names = [v.split(":")[0].split("=")[0].strip() for v in free_vars if v != "self"]
        head = f"def forward(self, args){maybe_return_annotation}:"
        if not names:
            return head + "\n    args.clear()"
        unpack = ", ".join(names) + ("," if len(names) == 1 else "")
        return f"{head}\n    {unpack} = args\n    args.clear()"


def compile_for_execution(gm: fx.GraphModule, accumulate: tuple[int, ...] = (),
                          into_dtypes: tuple | None = None, pause_after: tuple = ()) -> Callable:
    """``fn(args: list)`` computing gm's results from gm's arguments (run it under no_grad).

    Boxed: ``fn`` empties ``args`` on entry, so a caller that hands over its only reference to
    a saved tensor lets the program free it right after its last use.

    ``accumulate``: indices of results (weight gradients) that are added into accumulators
    instead of returned fresh. The function then takes one more argument per index, in that
    order (appended to ``args``), adds the result into it in place and returns it there. A
    result that is a matmul (``mm``, or ``t(mm)``) becomes ``addmm_`` into the accumulator, so
    the gradient of a linear layer is accumulated inside the GEMM (C += A B), with no separate
    sum over memory. ``into_dtypes``: the accumulators' dtypes (None: each result's own); a
    result whose accumulator has another dtype (an fp32 accumulator of a bf16 gradient, mixed
    precision) is cast as it is added (``add_``), never fused into the GEMM.

    ``pause_after``: ops (OpOverloads) after each call of which the function pauses: it is then
    a generator function (``yield`` after those calls; its value is ``StopIteration.value``),
    so that an executor can run another program while the op's communication is in flight
    (runtime/execute.py ``run_paired``).
    """
    graph = fx.Graph()
    val_map: dict[fx.Node, fx.Node] = {}
    out = graph.graph_copy(gm.graph, val_map)
    graph.output(out)
    simplify(graph)
    if accumulate:
        accumulate_into_arguments(graph, accumulate, into_dtypes)
    graph._codegen = _BoxedCodeGen()
    code = graph.python_code(root_module="self")
    glb = dict(code.globals)
    src = _OP_REF.sub(lambda m: _bind(m, glb), code.src)
    if pause_after:
        src = _pause_after(src, {_bound_name(op) for op in pause_after})
    filename = f"<autopar {type(gm).__name__} #{next(_counter)}>"
    linecache.cache[filename] = (len(src), None, src.splitlines(True), filename)  # readable tracebacks
    exec(compile(src, filename, "exec"), glb)
    fn = glb["forward"]
    fn.__autopar_source__ = src
    return fn.__get__(gm)


def _bound_name(op) -> str:
    ns, rest = op.name().split("::")
    return f"_op_{ns}_{rest}_{op._overloadname}"


def _pause_after(src: str, names: set[str]) -> str:
    """A ``yield`` after every line that calls one of the bound ops ``names``."""
    out = []
    for line in src.splitlines():
        out.append(line)
        stripped = line.lstrip()
        if "=" in stripped and stripped.split("=", 1)[1].lstrip().split("(", 1)[0] in names:
            out.append(line[: len(line) - len(stripped)] + "yield")
    return "\n".join(out) + "\n"


def _bind(m: re.Match, glb: dict) -> str:
    ns, name, overload = m.groups()
    try:
        op = getattr(getattr(getattr(torch.ops, ns), name), overload)
    except (AttributeError, RuntimeError):
        return m.group(0)
    if not isinstance(op, torch._ops.OpOverload):
        return m.group(0)
    key = f"_op_{ns}_{name}_{overload}"
    glb.setdefault(key, op._op)
    return key


def simplify(graph: fx.Graph) -> None:
    """The peepholes of the module docstring, in place; the graph still lints."""
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is aten.detach.default:
            _forward_uses(node, node.args[0], output)
        elif node.target is aten.t.default:
            src = node.args[0]
            if isinstance(src, fx.Node) and src.op == "call_function" and src.target is aten.t.default:
                _forward_uses(node, src.args[0], output)
        elif node.target is aten.view.default:
            src = node.args[0]
            if isinstance(src, fx.Node) and src.op == "call_function" and src.target is aten.view.default:
                node.args = (src.args[0], *node.args[1:])
                _erase_if_dead(src)
    _merge_masked_backward(graph)
    graph.lint()


def _forward_uses(node: fx.Node, value, output: fx.Node) -> None:
    """Make node's users read `value` instead; drop node if it is unused. The output keeps
    reading node when `value` is one of the program's arguments (a result is never an input)."""
    for user in list(node.users):
        if user is not output or (isinstance(value, fx.Node) and value.op != "placeholder"):
            user.replace_input_with(node, value)
    _erase_if_dead(node)


def _erase_if_dead(node: fx.Node) -> None:
    while node.op == "call_function" and not node.users and node.target in (
            aten.detach.default, aten.t.default, aten.view.default):
        src = node.args[0]
        node.graph.erase_node(node)
        if not isinstance(src, fx.Node):
            return
        node = src


def _merge_masked_backward(graph: fx.Graph) -> None:
    """One call per (op, args) where split_backward made an input-grad and a weight-grad call."""
    first: dict[tuple, fx.Node] = {}
    for node in list(graph.nodes):
        at = _MASKED.get(node.target) if node.op == "call_function" else None
        if at is None or node.kwargs:
            continue
        key = (node.target, *(a if not isinstance(a, list) else tuple(a)
                              for i, a in enumerate(node.args) if i != at))
        try:
            hash(key)
        except TypeError:
            continue
        other = first.setdefault(key, node)
        if other is node:
            continue
        # `other` comes first and reads the same values: it can compute both sets
        mask = [bool(a) or bool(b) for a, b in zip(other.args[at], node.args[at])]
        args = list(other.args)
        args[at] = mask
        other.args = tuple(args)
        for user in list(node.users):
            if user.op == "call_function" and user.target is operator.getitem:
                user.replace_input_with(node, other)
        if not node.users:
            graph.erase_node(node)


def _chunked_weight_grad(value, outs: list):
    """The ``linear_ce_grad_weight`` call whose only result ``value`` is (a head without bias),
    or None."""
    if not (isinstance(value, fx.Node) and value.op == "call_function" and value.target is operator.getitem
            and outs.count(value) == 1 and len(value.users) == 1):
        return None
    op = value.args[0]
    if (isinstance(op, fx.Node) and op.target is linear_ce.GRAD_WEIGHT_OP and len(op.users) == 1
            and op.args[3] is None):
        return op
    return None


def accumulate_into_arguments(graph: fx.Graph, indices: tuple[int, ...], into_dtypes: tuple | None = None) -> None:
    """Rewrite results ``indices`` as in-place accumulations into new trailing arguments (of
    ``into_dtypes``, default each result's dtype: only then can a matmul accumulate in place)."""
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    outs = list(output.args[0])
    first_op = next(n for n in graph.nodes if n.op != "placeholder")
    dead: list[fx.Node] = []
    for j, i in enumerate(indices):
        with graph.inserting_before(first_op):
            acc = graph.placeholder(f"accumulate_{j}")
        value = outs[i]
        val = value.meta.get("val") if isinstance(value, fx.Node) else None
        same_dtype = into_dtypes is None or (val is not None and val.dtype == into_dtypes[j])
        alone = same_dtype and isinstance(value, fx.Node) and outs.count(value) == 1 and len(value.users) == 1
        fused = None
        chunked = _chunked_weight_grad(value, outs)
        if chunked is not None:  # the chunked cross-entropy's head gradient, added in place (any dtype)
            with graph.inserting_before(output):
                graph.call_function(linear_ce.GRAD_WEIGHT_INTO_OP, (acc, *chunked.args))
            outs[i] = acc
            dead += [value, chunked]
            continue
        if alone and value.op == "call_function" and value.target is aten.mm.default:
            with graph.inserting_before(value):
                fused = graph.call_function(aten.addmm_.default, (acc, *value.args))
        elif (alone and value.op == "call_function" and value.target is aten.t.default
              and isinstance(value.args[0], fx.Node) and value.args[0].target is aten.mm.default
              and len(value.args[0].users) == 1):
            a, b = value.args[0].args  # t(a @ b) = t(b) @ t(a)
            with graph.inserting_before(value):
                fused = graph.call_function(aten.addmm_.default, (
                    acc, graph.call_function(aten.t.default, (b,)), graph.call_function(aten.t.default, (a,))))
        if fused is None:
            with graph.inserting_before(output):
                fused = graph.call_function(aten.add_.Tensor, (acc, value))
        outs[i] = fused
    output.args = (tuple(outs),)
    for node in dead:
        graph.erase_node(node)
    for node in reversed(list(graph.nodes)):  # the replaced mm / t(mm) nodes
        if node.op == "call_function" and not node.users and node.target in (aten.mm.default, aten.t.default):
            graph.erase_node(node)
    graph.lint()
