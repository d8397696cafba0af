"""Capture model + loss for one microbatch as one functional ATen graph (torch.export, non-strict).

The captured graph's placeholders are, in order: parameters, buffers (and lifted constants),
then the model inputs, then the target (when a loss_fn is given). Its outputs are the new
values of mutated buffers (BatchNorm running stats, functionalized by export), then the
scalar loss. Parameters and buffers keep their original FQNs; a parameter reachable under
several names (tied embedding / LM head) becomes one placeholder under its first name.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import logging
import os
import re
import traceback
import warnings

import torch
import torch.fx as fx
import torch.nn as nn
from torch.export.graph_signature import InputKind, OutputKind
from torch.utils._pytree import tree_leaves

from autopar.collectives.moe_exchange import entries_of, serving
from autopar.errors import CaptureError

from .captured import CapturedGraph
from .causal_mask import make_causal
from .costs import annotate_costs
from .grad_mode import detach_no_grad_outputs, grad_mode_capture

log = logging.getLogger("autopar")


class _ModelWithLoss(nn.Module):
    """What gets exported: model(*inputs) (or ``model(**dict(zip(names, inputs)))``) followed by
    loss_fn(output, target); without a loss_fn the output is the loss (a ``.loss`` / ``["loss"]``
    of a Hugging Face ``ModelOutput`` or dict)."""

    def __init__(self, model: nn.Module, loss_fn, num_inputs: int, names: tuple[str, ...] | None = None):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn
        self.num_inputs = num_inputs
        self.names = names

    def forward(self, *args):
        inputs = args[: self.num_inputs]
        out = self.model(**dict(zip(self.names, inputs))) if self.names is not None else self.model(*inputs)
        if self.loss_fn is not None:
            return self.loss_fn(out, args[self.num_inputs])
        if isinstance(out, torch.Tensor):
            return out
        loss = out.get("loss") if isinstance(out, dict) else getattr(out, "loss", None)
        if loss is None:
            raise ValueError(f"autopar: loss_fn=None, but the model returned a {type(out).__name__} without a loss; "
                             "pass a loss_fn, or the labels the model computes its loss from")
        return loss


def capture(model: nn.Module, inputs: tuple, target=None, loss_fn=None,
            input_names: tuple[str, ...] | None = None, causal_masks: bool = True) -> CapturedGraph:
    """Capture ``loss_fn(model(*inputs), target)`` (or ``model(*inputs)`` when loss_fn is None).

    ``inputs``/``target`` are one microbatch; with ``input_names`` the inputs are passed as
    those keyword arguments. Raises CaptureError naming the user's source line when the model
    can't be captured as one static graph. ``causal_masks``: attention masks that are statically
    causal become SDPA's ``is_causal`` (passes/causal_mask.py); off for a capture of one sequence
    shard, where a window as long as the shard is causal there but not over the whole sequence
    (the context-parallel pass rebuilds the masks of the whole sequence).
    """
    if not isinstance(inputs, (tuple, list)):
        inputs = (inputs,)
    inputs = tuple(inputs)
    for i, x in enumerate(inputs):
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"autopar: model input {i} is a {type(x).__name__}; every input must be a tensor "
                             "(bind non-tensor arguments with functools.partial or a wrapper module)")
    if loss_fn is not None and target is None:
        raise ValueError("autopar: a loss_fn was given but no target; pass the target, or loss_fn=None "
                         "if the model returns its loss")
    if isinstance(loss_fn, nn.Module) and any(True for _ in loss_fn.parameters()):
        raise ValueError("autopar: loss_fn has parameters; move them into the model so the optimizer sees them")
    wrapper = _ModelWithLoss(model, loss_fn, len(inputs), input_names)
    args = inputs + ((target,) if loss_fn is not None else ())
    files = _model_files(model, loss_fn)  # where a failure is the user's to fix
    try:
        with _quiet_export_logs(), grad_mode_capture(lambda stack: _pick_frame(stack, files, strict=True)) as lost:
            ep = torch.export.export(wrapper, args, strict=False)
        if lost:
            raise CaptureError(
                f"autopar could not capture {type(model).__name__}: gradients are turned off inside a torch.autocast "
                f"block at {_where(lost[0])}; torch.export keeps no record of that region, and its values would "
                "carry gradients.\n  Fix: open the no_grad block outside the autocast block (or autocast outside "
                "the model: the usual place), or .detach() the values it computes.")
        with _quiet_export_logs():
            _refuse_data_dependent_shapes(ep, model, files)
            # before the decomposition inlines the grad-mode regions: their outputs carry no gradient
            detach_no_grad_outputs(ep.graph_module, {s.arg.name for s in ep.graph_signature.input_specs
                                                     if s.kind == InputKind.PARAMETER})
            # functionalize (buffer mutations become outputs); aten.copy alone is decomposed
            ep = ep.run_decompositions({torch.ops.aten.copy.default: _differentiable_copy})
    except CaptureError:
        raise
    except Exception as e:  # noqa: BLE001 - every failure is re-raised as CaptureError with context
        raise CaptureError(_explain_capture_failure(model, files, e)) from e
    captured = _from_exported(ep, wrapper, model, loss_fn is not None)
    _copy_before_training_views(captured, model)
    if causal_masks:
        make_causal(captured.gm)
    with serving(entries_of(model)):  # a dropless MoE's ops are priced from their experts' entries
        annotate_costs(captured.gm)
    captured.gm.graph.lint()
    return captured


def _from_exported(ep, wrapper: nn.Module, model: nn.Module, has_target: bool) -> CapturedGraph:
    gm = ep.graph_module
    graph = gm.graph
    sig = ep.graph_signature
    canonical = {}  # id(param) -> canonical fqn
    aliases: dict[str, list[str]] = {}
    for fqn, p in model.named_parameters(remove_duplicate=False):
        key = id(p)
        if key not in canonical:
            canonical[key] = fqn
        aliases.setdefault(canonical[key], []).append(fqn)
    by_name = {n.name: n for n in graph.nodes}

    params: dict[str, str] = {}
    buffers: dict[str, str] = {}
    constants: dict[str, torch.Tensor] = {}
    user_inputs: list[str] = []
    first_placeholder_of: dict[int, fx.Node] = {}  # id(tensor) -> placeholder kept
    for spec in sig.input_specs:
        name = spec.arg.name
        node = by_name[name]
        if spec.kind == InputKind.PARAMETER:
            tensor = wrapper.get_parameter(spec.target)
            fqn = canonical.get(id(tensor))
            if fqn is None:
                raise CaptureError(f"autopar: parameter {spec.target} is not a parameter of the model "
                                   "(loss functions must not own parameters)")
        elif spec.kind == InputKind.BUFFER:
            tensor = wrapper.get_buffer(spec.target)
            fqn = _strip_model_prefix(spec.target)
        elif spec.kind == InputKind.CONSTANT_TENSOR:
            constants[name] = ep.constants[spec.target]
            continue
        elif spec.kind == InputKind.USER_INPUT:
            user_inputs.append(name)
            continue
        else:
            raise CaptureError(f"autopar: captured graph has an input of kind {spec.kind.name} ({name}); "
                               "only parameters, buffers, constants and tensor inputs are supported")
        kept = first_placeholder_of.get(id(tensor))
        if kept is not None:
            # The same tensor under a second name (tied weights): one placeholder, one gradient.
            node.replace_all_uses_with(kept)
            graph.erase_node(node)
            continue
        first_placeholder_of[id(tensor)] = node
        (params if spec.kind == InputKind.PARAMETER else buffers)[name] = fqn

    buffer_updates: dict[str, str] = {}
    loss_name = None
    out_node = next(n for n in graph.nodes if n.op == "output")
    out_values = list(out_node.args[0])
    for spec, value in zip(sig.output_specs, out_values):
        if spec.kind == OutputKind.BUFFER_MUTATION:
            buffer_updates[value.name] = _strip_model_prefix(spec.target)
        elif spec.kind == OutputKind.USER_OUTPUT:
            if loss_name is not None:
                raise CaptureError("autopar: the loss must be one scalar tensor; the model+loss returned several "
                                   "values (pass a loss_fn that reduces the output to a scalar)")
            loss_name = value.name
        elif spec.kind == OutputKind.USER_INPUT_MUTATION:
            raise CaptureError(f"autopar: the model mutates its input {spec.target} in place; "
                               "clone the input before modifying it")
        else:
            raise CaptureError(f"autopar: the model mutates {spec.target} ({spec.kind.name}) during forward; "
                               "only buffer updates are supported")
    if loss_name is None or not isinstance(by_name[loss_name].meta.get("val"), torch.Tensor):
        raise CaptureError("autopar: model+loss must return one scalar tensor (the loss); "
                           "pass loss_fn(output, target), or return the loss from the model with loss_fn=None")
    loss_val = by_name[loss_name].meta["val"]
    if loss_val.dim() != 0 or not loss_val.is_floating_point():
        raise ValueError(f"autopar: the loss must be a floating-point scalar; got shape {tuple(loss_val.shape)} "
                         f"dtype {loss_val.dtype} (reduce it with .mean() or .sum() in loss_fn)")
    gm.recompile()
    target = user_inputs[-1] if has_target else None
    model_inputs = user_inputs[:-1] if has_target else user_inputs
    return CapturedGraph(gm=gm, params=params, buffers=buffers, constants=constants, inputs=model_inputs,
                         target=target, buffer_updates=buffer_updates, loss=loss_name, aliases=aliases)


_VIEWS = (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default)


def _copy_before_training_views(captured: CapturedGraph, model: nn.Module) -> None:
    """Make the graph's views valid for the layouts training produces, not only the traced ones.

    Export records values without ``requires_grad``, and some kernels pick their output layout
    from it: SDPA with a mask that requires grad (T5's learned relative position bias) runs the
    math kernel, whose output is ``[B, H, S, D]``-contiguous, while the traced one was the flash
    kernel's ``[B, S, H, D]`` layout. A model's ``x.transpose(1, 2).contiguous().view(...)`` (or
    ``reshape``) on that output was then recorded as a bare ``view`` (the ``.contiguous()`` was a
    no-op at trace time), which fails on the training layout: in the joint trace of
    split_backward and on real tensors. This replays the graph on fake tensors with the
    parameters' ``requires_grad`` and puts the dropped copy back (``clone``, contiguous) before
    each view that cannot view what training feeds it. Graphs without such a view are unchanged.
    """
    from torch._guards import detect_fake_mode

    from .costs import is_random

    gm, graph = captured.gm, captured.gm.graph
    phs = [n for n in graph.nodes if n.op == "placeholder"]
    fake_mode = detect_fake_mode([n.meta.get("val") for n in phs])
    if fake_mode is None:
        return
    grad = {name: model.get_parameter(fqn).requires_grad for name, fqn in captured.params.items()}
    env: dict[fx.Node, object] = {}
    changed = False
    with fake_mode, torch.enable_grad():
        for node in graph.nodes:
            val = node.meta.get("val")
            if node.op == "placeholder":
                if isinstance(val, torch.Tensor):
                    val = val.detach()
                    if grad.get(node.name, False) and val.is_floating_point():
                        val.requires_grad_(True)
                env[node] = val
            elif node.op == "get_attr":
                env[node] = getattr(gm, node.target)
            elif node.op == "call_function":
                args = fx.node.map_arg(node.args, lambda a: env[a])
                kwargs = fx.node.map_arg(node.kwargs, lambda a: env[a])
                if is_random(node) and isinstance(val, torch.Tensor):
                    # no RNG draws while checking layouts; the traced value, with its inputs' grad
                    needs = any(a.requires_grad for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor))
                    env[node] = val.detach().requires_grad_(needs and val.is_floating_point())
                    continue
                try:
                    env[node] = node.target(*args, **kwargs)
                    continue
                except Exception:  # noqa: BLE001 - judged below: a view we can fix, or the traced value
                    if node.target not in _VIEWS or not isinstance(node.args[0], fx.Node):
                        env[node] = val
                        continue
                src = node.args[0]
                with graph.inserting_before(node):
                    dense = graph.call_function(torch.ops.aten.clone.default, (src,),
                                                {"memory_format": torch.contiguous_format})
                dense.meta.update({k: v for k, v in node.meta.items() if k != "val"})
                dense.meta["val"] = src.meta["val"].clone(memory_format=torch.contiguous_format)
                node.replace_input_with(src, dense)
                env[dense] = env[src].clone(memory_format=torch.contiguous_format)
                env[node] = node.target(env[dense], *args[1:], **kwargs)
                changed = True
    if changed:
        gm.recompile()


def _differentiable_copy(self: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    """``aten.copy(self, src)``: ``src`` broadcast to ``self``'s shape, in its dtype and device.

    Functionalization turns a write into a view (``buf[..., :4] = x``: DeepSeek-V3's MLA
    ``expand_kv``, any slice assignment) into ``aten.copy`` + ``slice_scatter``, and
    ``aten.copy`` has no autograd formula, so split_backward's joint trace would fail with
    "derivative for aten::copy is not implemented". These ops have one (gradient to ``src``
    only: ``self``'s old values are overwritten)."""
    out = torch.ops.aten.expand.default(src, list(self.shape))
    if out.dtype != self.dtype or out.device != self.device:
        return torch.ops.aten._to_copy.default(out, dtype=self.dtype, device=self.device)
    return torch.ops.aten.clone.default(out)


def _strip_model_prefix(target: str) -> str:
    assert target.startswith("model."), target
    return target[len("model."):]


@contextlib.contextmanager
def _quiet_export_logs():
    """torch.export logs whole graphs at WARNING on data-dependent failures; our error says it better."""
    names = ["torch.fx.experimental.symbolic_shapes", "torch._export", "torch.export", "torch._dynamo"]
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    try:
        for lg in loggers:
            lg.setLevel(logging.ERROR)
        with warnings.catch_warnings(), _without_partial_graph():
            # torch's own deep copy of its module call graph warns about its own pytree API
            warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
            yield
    finally:
        for lg, lvl in zip(loggers, levels):
            lg.setLevel(lvl)


@contextlib.contextmanager
def _without_partial_graph():
    """torch.export prints the partial graph of a failed trace to stderr (``partial_fx_graph``)
    before raising; the CaptureError names the line instead. Everything else written to stderr
    meanwhile (the model's own warnings) is passed on."""
    import io
    import sys

    buffer, real = io.StringIO(), sys.stderr
    sys.stderr = buffer
    try:
        yield
    except BaseException as e:
        text, chained = buffer.getvalue(), e
        while chained is not None:
            partial = getattr(chained, "partial_fx_graph", None)
            if partial is not None:
                text = text.replace(str(partial) + "\n", "")
            chained = chained.__cause__ or chained.__context__
        buffer = io.StringIO(text)
        raise
    finally:
        sys.stderr = real
        real.write(buffer.getvalue())


_TORCH_DIR = os.path.dirname(torch.__file__)


@functools.cache
def _own_dirs() -> tuple[tuple[str, ...], str]:
    """(autopar's layer folders, its examples folder): frames in the first are not the user's."""
    layers = ("autopar", "autopar.passes", "autopar.runtime", "autopar.parallel", "autopar.planner",
              "autopar.schedules")
    dirs = tuple(os.path.dirname(os.path.abspath(importlib.import_module(n).__file__)) for n in layers)
    return dirs, os.path.dirname(os.path.abspath(importlib.import_module("autopar.examples").__file__))


_FRAME = re.compile(r'File "([^"]+)", line (\d+), in [^\n]*\n\s*([^\n]*)')


def _infrastructure(filename: str) -> bool:
    """Frames no user wrote: torch, the standard library, autopar's own layers, generated code."""
    import sysconfig

    fn = os.path.abspath(filename)
    return (filename.startswith("<") or fn.startswith(_TORCH_DIR) or fn.startswith(sysconfig.get_paths()["stdlib"])
            or (any(fn.startswith(d + os.sep) for d in _own_dirs()[0]) and not fn.startswith(_own_dirs()[1] + os.sep)))


def _model_files(model: nn.Module, loss_fn) -> set[str]:
    """Source files of the model's module classes (and of the loss function) outside torch: where
    a capture failure is the user's to fix (their own file, or transformers' modeling file)."""
    files = set()
    for obj in [type(m) for m in model.modules()] + ([loss_fn if inspect.isfunction(loss_fn) else type(loss_fn)]
                                                     if loss_fn is not None else []):
        try:
            f = inspect.getsourcefile(obj)
        except (TypeError, OSError):
            continue
        if f and not _infrastructure(f):
            files.add(os.path.abspath(f))
    return files


def _pick_frame(frames: list[tuple[str, int, str]], files: set[str], strict: bool = False):
    """The deepest (file, line, code) in the model's own files, else the deepest no library wrote
    (``strict``: only the model's own files, else None)."""
    usable = [] if strict else [f for f in frames if not _infrastructure(f[0]) and "site-packages" not in f[0]]
    in_model = [f for f in frames if os.path.abspath(f[0]) in files]
    return (in_model or usable or [None])[-1]


def _traceback_frames(exc: BaseException) -> list[tuple[str, int, str]]:
    """Every frame of ``exc`` and the exceptions chained to it, outermost first."""
    frames, seen, e = [], set(), exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        frames = [(f.filename, f.lineno, f.line or "") for f in traceback.extract_tb(e.__traceback__)] + frames
        e = e.__cause__ or e.__context__
    return frames


def node_source(node: fx.Node, files: set[str]):
    """(file, line, code) of the model statement that made ``node`` (its recorded stack trace)."""
    frames = [(f, int(n), code) for f, n, code in _FRAME.findall(node.meta.get("stack_trace") or "")]
    return _pick_frame(frames, files)


def _where(frame) -> str:
    if frame is None:
        return "a line torch did not record (run model(*inputs) under torch.export.export(..., strict=False) to see it)"
    return f"{frame[0]}:{frame[1]}: `{frame[2].strip()}`"


_DATA_DEPENDENT_SIZE = ("a number read from a tensor (`.tolist()`, `.item()`, `int(tensor)`) used where a static graph "
                        "needs a fixed value (a size, a split, a range)")
_SIZE_FIX = ("keep shapes fixed: pad to a capacity, use masks (torch.where) instead of selections; for MoE expert "
             "split sizes use autopar.nn.MoE or the Hugging Face experts layout (experts(hidden, top_k_index, "
             "top_k_weights) with 3-D expert weights), which autopar dispatches dropless with the sizes moved at "
             "run time, not traced")


def _explain_capture_failure(model: nn.Module, files: set[str], exc: BaseException) -> str:
    text = str(exc)
    kind = type(exc).__name__
    frame = _pick_frame(_traceback_frames(exc), files)
    if "could not extract specialized integer" in text.lower():
        what, fix = _DATA_DEPENDENT_SIZE, _SIZE_FIX
    elif "data-dependent" in text or "GuardOnDataDependent" in kind or "DataDependent" in kind:
        what = "data-dependent Python control flow (a branch or shape that depends on tensor values)"
        fix = ("make it tensor-only, e.g. torch.where(cond, a, b) instead of `if`, fixed-size masks "
               "instead of boolean indexing, or torch.cond for real branches")
    elif "not supported" in text.lower() or "unsupported" in text.lower() or "NotImplemented" in kind:
        what = "an operation torch.export cannot capture"
        fix = "replace it with a standard torch op, or register it as a custom op with a fake (meta) kernel"
    else:
        what = f"{kind}"
        fix = "check that model(*inputs) and loss_fn run eagerly on these inputs; see the chained error below"
    first = text.strip().splitlines()[0] if text.strip() else kind
    return (f"autopar could not capture {type(model).__name__}: {what} at {_where(frame)}.\n"
            f"  Fix: {fix}.\n  torch.export said: {first[:300]}")


def _refuse_data_dependent_shapes(ep, model: nn.Module, files: set[str]) -> None:
    """torch.export captures a value whose shape depends on data (``x[mask]``, ``nonzero``,
    ``unique``, a split by sizes read with ``.tolist()``) as an unbacked size; no stage cut,
    memory plan or fixed-shape program can hold it. Refused here, naming the model line that
    made it, instead of failing later inside a pass."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    for node in ep.graph_module.graph.nodes:
        shapes = [tuple(v.shape) for v in tree_leaves(node.meta.get("val")) if isinstance(v, torch.Tensor)]
        if node.op == "call_function" and free_unbacked_symbols(shapes):
            where = _where(node_source(node, files))
            raise CaptureError(
                f"autopar could not capture {type(model).__name__}: a data-dependent shape (boolean-mask indexing, "
                f"nonzero, unique, or sizes read from a tensor) at {where}: `{node.target}` makes a tensor whose "
                f"size depends on the data.\n  Fix: {_SIZE_FIX}.")
