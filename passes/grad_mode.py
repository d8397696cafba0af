"""Grad-mode regions of a forward (``no_grad``, ``set_grad_enabled(False)``, ``inference_mode``)
kept as what they mean: values computed there carry no gradient.

``torch.export`` (non-strict, torch 2.11 and 2.13) records a region run with gradients off as a
``wrap_with_set_grad_enabled(False, submodule, *args)`` higher-order op, and a region that turns
them back on inside one (``enable_grad``) as plain ops between two such wrappers. The
decomposition that follows capture inlines the wrappers and drops the mode, so every later pass
(the joint trace of split_backward above all) would see ordinary ops and let gradients flow
through them. ``detach_no_grad_outputs`` puts the meaning into the graph itself before that: each
floating-point value that leaves a no-grad region is read through ``aten.detach``, so the stage
cuts, the I/W split, recomputation, every parallelism's rewrite and the planner's costs (the
backward has no work there) all follow without knowing about grad modes. A parameter used only
inside such a region gets no gradient, as in eager.

``inference_mode`` is not recorded by export at all (its ops land in the graph as if gradients
were on); ``grad_mode_capture`` makes it enter ``no_grad`` while a model is captured, which is
its meaning for gradients (inference tensors' other restrictions do not matter to a captured
graph). A no-grad region inside a ``torch.autocast`` block in forward is not recorded either
(export nests it in the autocast wrapper with no grad-mode wrapper): ``grad_mode_capture``
notes where one starts, and the capture refuses it by name.
"""
from __future__ import annotations

import contextlib
import operator

import torch
import torch.fx as fx
from torch.utils._pytree import tree_leaves

from autopar.errors import CaptureError

_WRAP = torch.ops.higher_order.wrap_with_set_grad_enabled


@contextlib.contextmanager
def grad_mode_capture(user_frame):
    """While a model is exported: ``torch.inference_mode()`` (as a context manager or a decorator,
    applied before or after this is entered) turns gradients off as ``no_grad`` does, so export
    records its region (``inference_mode(False)`` leaves the grad mode as it is); and every place
    where model code turns gradients off inside a ``torch.autocast`` block is collected in the
    yielded list (when the autocast block is the model's own, opened during the capture), as
    ``user_frame(stack)`` names it (``(file, line, code)``, or None for frames
    of torch or autopar): torch.export (2.11, 2.13) keeps no record of such a region, its ops
    land in the autocast wrapper as if gradients were on, and the capture must refuse it."""
    import traceback

    inference, grad = torch.autograd.grad_mode.inference_mode, torch.autograd.grad_mode.set_grad_enabled
    enter, exit_, init = inference.__enter__, inference.__exit__, grad.__init__
    lost: list[tuple[str, int, str]] = []
    outer = _autocast_on()  # a capture run inside the user's own autocast: not the model's block

    def _enter(self):
        self._autopar_no_grad = torch.no_grad() if self.mode else contextlib.nullcontext()
        self._autopar_no_grad.__enter__()

    def _exit(self, *exc):
        self._autopar_no_grad.__exit__(*exc)

    def _init(self, mode: bool) -> None:
        if not mode and torch.is_grad_enabled() and not outer and _autocast_on():
            frame = user_frame([(f.filename, f.lineno, f.line or "") for f in traceback.extract_stack()])
            if frame is not None:
                lost.append(frame)
        init(self, mode)

    inference.__enter__, inference.__exit__, grad.__init__ = _enter, _exit, _init
    try:
        yield lost
    finally:
        inference.__enter__, inference.__exit__, grad.__init__ = enter, exit_, init


def _autocast_on() -> bool:
    return any(torch.is_autocast_enabled(device) for device in ("cpu", "cuda"))


def detach_no_grad_outputs(gm: fx.GraphModule, param_names: set[str]) -> int:
    """Read every floating-point output of a ``wrap_with_set_grad_enabled(False, ...)`` region of
    ``gm`` (an exported program's graph, before decomposition) through ``aten.detach``, where the
    region reads a parameter (directly or through earlier values); ``param_names`` are the
    placeholders that are parameters. An output that is one of the region's own inputs handed
    back unchanged keeps its gradient (in eager, ``with no_grad: w = self.w`` is ``self.w``).
    Edits ``gm`` in place; returns how many values were detached."""
    graph = gm.graph
    reaches_param: set[fx.Node] = set()
    detached = 0
    for node in list(graph.nodes):
        if node.op == "placeholder":
            if node.name in param_names:
                reaches_param.add(node)
            continue
        if any(a in reaches_param for a in node.all_input_nodes):
            reaches_param.add(node)
        if node.target is not _WRAP or node.args[0] is not False:
            continue
        body = getattr(gm, node.args[1].target)
        _refuse_nested_enable(body, node)
        if node not in reaches_param:
            continue  # no gradient could flow through it anyway (rotary tables from buffers)
        passthrough = _passthrough_outputs(body)
        for use in list(node.users):
            if use.target is not operator.getitem or use.args[1] in passthrough or not _float_valued(use):
                continue
            with graph.inserting_after(use):
                cut = graph.call_function(torch.ops.aten.detach.default, (use,))
            cut.meta.update(use.meta)
            use.replace_all_uses_with(cut, delete_user_cb=lambda u, cut=cut: u is not cut)
            detached += 1
    if detached:
        graph.lint()
        gm.recompile()
    return detached


def _passthrough_outputs(body: fx.GraphModule) -> set[int]:
    out = next(n for n in body.graph.nodes if n.op == "output")
    values = out.args[0] if isinstance(out.args[0], (tuple, list)) else (out.args[0],)
    return {i for i, v in enumerate(values) if isinstance(v, fx.Node) and v.op == "placeholder"}


def _refuse_nested_enable(body: fx.GraphModule, node: fx.Node) -> None:
    """torch.export lifts an ``enable_grad`` region out of the surrounding no-grad one (its ops run
    between two wrappers); a wrapper nested inside another would break the one-level reading
    above, so it is refused by name rather than read wrongly."""
    for inner in body.graph.nodes:
        if inner.target is _WRAP:
            raise CaptureError(
                f"autopar: the grad-mode region {node.name} holds another grad-mode region ({inner.name}); "
                "torch.export normally flattens them. Move the inner `torch.enable_grad()` block out of the "
                "`torch.no_grad()` block, or compute it before entering it.")


aten = torch.ops.aten
# Ops whose float result carries no gradient back to their tensor inputs (autograd gives those
# inputs None through them): the detach a no-grad region's outputs are read through, a user's
# own ``.detach()``, and the factories that only read an input's shape, dtype or device.
NO_GRADIENT_OPS = frozenset({
    aten.detach.default, aten.zeros_like.default, aten.ones_like.default, aten.empty_like.default,
    aten.full_like.default, aten.rand_like.default, aten.randn_like.default, aten.randint_like.default,
    aten.new_zeros.default, aten.new_ones.default, aten.new_empty.default, aten.new_full.default,
})


def gradient_paths(graph: fx.Graph, loss: fx.Node) -> set[fx.Node]:
    """The nodes of ``graph`` from which the loss can be reached over ops that pass a gradient
    back (floating-point values, never through ``NO_GRADIENT_OPS``). A value outside this set
    gets no gradient from the loss, whatever requires grad: a stage cut just before the detach
    of a no-grad region's output must not send that value a gradient (a zero one would give
    the earlier stage's parameters zero gradients where eager gives them none)."""
    live = {loss}
    for node in reversed(graph.nodes):
        if node in live or not _float_valued(node):
            continue
        if any(u in live and u.target not in NO_GRADIENT_OPS for u in node.users):
            live.add(node)
    return live


def _float_valued(node: fx.Node) -> bool:
    return any(isinstance(v, torch.Tensor) and (v.is_floating_point() or v.is_complex())
               for v in tree_leaves(node.meta.get("val")))


def params_with_gradient(captured) -> set[str]:
    """Canonical FQNs of the parameters some path to the loss gives a gradient (``gradient_paths``
    over the whole captured graph): every rank knows them, also of the stages it does not hold.
    A parameter outside (used only inside a no-grad region) is trained nowhere, as in eager."""
    graph = captured.gm.graph
    live = gradient_paths(graph, captured.node(captured.loss))
    return {fqn for name, fqn in captured.params.items() if captured.node(name) in live}
