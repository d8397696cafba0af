"""Stage programs compiled by Inductor (``Plan(compile=True)``).

Each F, I, W and B program is an FX graph of aten ops (passes/split_backward.py); with
``compile`` on, the runtime calls Inductor's code for it in its place: C++/OpenMP kernels on CPU,
Triton on GPU, element-wise chains (the backward's values made again included) fused into the
kernels that read them. The GraphModule goes to Inductor as the graph it is
(``torch._inductor.compile_fx.compile_fx``, what ``torch.compile``'s Inductor backend calls with
the graph Dynamo traced): it already is a flat graph of aten calls, so there is nothing for Dynamo
to trace, and no guards to evaluate per call (about 80 us a call on a stage program with some 40
tensor arguments, 88 calls a step at pp=2 zbv with 8 microbatches). AOTAutograd sees an
inference graph (the runtime runs programs under ``no_grad``); Inductor's on-disk caches
(AOTAutograd's and the FX graph cache) answer a program it compiled before, in this process or
an earlier one (identical stages included).

What the guards would check is a key here: the compiled code is specialized to its arguments'
shapes, strides and dtypes (and grad mode), and a call whose arguments differ compiles again
(the log says so; ``Program.compile_s`` adds it up).

A graph that calls anything but ops (ZeRO-3's ``_Fetch``/``_Release`` modules, which must run
as eager calls between compiled pieces so the gather buffers keep their order) goes through
``torch.compile(gm, backend="inductor", dynamic=False)`` instead: Dynamo breaks the graph there
(they are ``torch.compiler.disable``d) and guards the pieces; the log names the node.

What stays as it was:

* the calling convention: ``fn(args: list)``, the program's arguments then, where gradients
  accumulate over microbatches, the tensors to add its gradient results into (added after the
  compiled call, in place: ``into[i] += result``, at the accumulator's dtype);
* programs that leave communication in flight (MoE dispatch chains paused for an F&B unit,
  runtime/execute.py ``start``) run op by op, as do programs Inductor cannot compile: the log
  names the program and the reason, once;
* the GraphModule itself (``pm.dump`` prints it; ``stages.txt`` says which programs run compiled).

Inductor's default (Python) wrapper: its ``cpp_wrapper`` was measured on examples/gpt (8 layers,
d 128, one thread): a stage F call 3.1 ms against 3.9 ms, but the first compile 1.8x longer and
the zbv step no faster (benchmarks/compile.py), so it is not used.

Compile time is paid at a program's first call (the arguments' shapes are known then); the log
reports it per program and the program keeps it (``Program.compile_s``; ``compile_report`` sums
them). A second process on a warm Inductor cache pays 0.3-0.8 s for all of examples/gpt's
programs against ~16 s cold (benchmarks/compile.py).
"""
from __future__ import annotations

import dataclasses
import logging
import operator
import time

import torch
import torch.fx

log = logging.getLogger("autopar")

_COMPILED = "_autopar_compiled"  # attribute of the GraphModule: (its code when compiled, {key: compiled})


def _signature(a):
    if isinstance(a, torch.Tensor):
        return a.shape, a.stride(), a.dtype, a.device
    if isinstance(a, (tuple, list)):  # a node of several results F passes on whole (native_layer_norm's)
        return tuple(_signature(x) for x in a)
    return a


def _key(args) -> tuple:
    """What Inductor's code for a graph is specialized to: each tensor argument's shape, strides,
    dtype and device (other arguments by value), and grad mode. (Per call: the tensors inline.)"""
    return torch.is_grad_enabled(), *[(a.shape, a.stride(), a.dtype, a.device) if isinstance(a, torch.Tensor)
                                      else _signature(a) for a in args]


def _multi(node) -> int | None:
    """How many results a node of several has (``native_layer_norm``'s 3), None for a tensor."""
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    if isinstance(val, (tuple, list)):
        return len(val)
    schema = getattr(node.target, "_schema", None) if isinstance(node, torch.fx.Node) else None
    return len(schema.returns) if schema is not None and len(schema.returns) > 1 else None


def _needs_dynamo(gm: torch.fx.GraphModule) -> str | None:
    """The first node Inductor cannot take as part of one graph (a module or Python function
    call), None when every node is an op (aten, functional collective, custom) or a getitem."""
    for n in gm.graph.nodes:
        if n.op in ("placeholder", "output", "get_attr"):
            continue
        if n.op == "call_function" and (isinstance(n.target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket))
                                        or n.target is operator.getitem):
            continue
        return f"{n.op} {n.target if n.op != 'call_module' else n.target!r}"
    return None


def _inductor(gm: torch.fx.GraphModule, args: list):
    """Inductor's callable for ``gm`` at these arguments: ``compile_fx`` on a copy whose output is
    flat (a program may return a node of several results whole, which AOTAutograd refuses), its
    results put back in the program's structure; constants among the results stay out of it."""
    from torch._guards import TracingContext, tracing
    from torch._inductor.compile_fx import compile_fx
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    from torch.utils import _pytree as pytree

    graph = gm.graph.__deepcopy__()
    out = graph.output_node()
    flat, rebuild = [], []  # rebuild[i]: ("one", index into flat), ("many", indices) or ("const", value)
    with graph.inserting_before(out):
        for r in out.args[0]:
            k = _multi(r)
            if not isinstance(r, torch.fx.Node):
                rebuild.append(("const", r))
            elif k is None:
                rebuild.append(("one", len(flat)))
                flat.append(r)
            else:
                rebuild.append(("many", range(len(flat), len(flat) + k)))
                flat += [graph.call_function(operator.getitem, (r, j)) for j in range(k)]
    out.args = (tuple(flat),)
    # a fake mode with a shape environment, as Dynamo gives it: Inductor's and AOTAutograd's
    # on-disk caches key on it (without one they are bypassed); every shape static
    fake = FakeTensorMode(shape_env=ShapeEnv())
    examples = pytree.tree_map_only(torch.Tensor, lambda t: fake.from_tensor(t, static_shapes=True), list(args))
    with tracing(TracingContext(fake)):
        compiled = compile_fx(torch.fx.GraphModule(gm, graph), examples)

    def call(*a):
        outs = compiled(*a)
        return [outs[v] if how == "one" else tuple(outs[j] for j in v) if how == "many" else v
                for how, v in rebuild]

    return call


def compiled_executable(program, accumulate: tuple[int, ...]) -> object:
    """``fn(args: list)`` running ``program`` compiled (see the module docstring); the results at
    ``accumulate`` are added into the extra trailing arguments, which then stand for them. A
    compiling call's seconds go to ``program.compile_s`` and the log."""
    gm = program.gm
    entry = gm.__dict__.get(_COMPILED)
    if entry is None or entry[0] is not gm.code:
        entry = gm.__dict__[_COMPILED] = (gm.code, {})
    variants = entry[1]
    n = len(program.args)
    dynamo = _needs_dynamo(gm)  # then Dynamo guards (and recompiles) itself: one entry

    def fn(args: list):
        into, call = args[n:], args[:n]
        key = None if dynamo else _key(call)
        compiled = variants.get(key)
        if compiled is None:
            t0 = time.perf_counter()
            compiled = torch.compile(gm, backend="inductor", dynamic=False) if dynamo else _inductor(gm, call)
            outs = list(compiled(*call))
            variants[key] = compiled
            secs = time.perf_counter() - t0
            program.compile_s = (program.compile_s or 0.0) + secs
            how = f", through Dynamo: it calls {dynamo}" if dynamo else ""
            log.info("autopar: compiled %s in %.2f s (%s%s)", program.compiled_as, secs,
                     "new argument shapes" if len(variants) > 1 else "its first call", how)
        else:
            outs = list(compiled(*call))
        args.clear()
        for i, acc in zip(accumulate, into):
            acc.add_(outs[i])
            outs[i] = acc
        return outs

    return fn


def compiled_programs(stage_programs: list, stages, label: str = "stage {} ") -> list:
    """``stage_programs`` (indexed by stage) with the F, I, W and B programs of ``stages`` marked to
    run compiled, labelled "stage N F" (``label`` formatted with the index, then the program):
    copies (the split programs may be shared, e.g. by a memoized capture), the GraphModules shared."""
    out = list(stage_programs)
    for s in stages:
        sp = out[s]
        out[s] = sp.with_programs(**{k: dataclasses.replace(getattr(sp, k), compiled_as=label.format(s) + k.upper(),
                                                            compile_s=None, compile_failure=None)
                                     for k in ("f", "i", "w", "b")})
    return out


def compile_report(stage_programs) -> str:
    """One line: compile seconds in total and per program so far, and the programs that run op
    by op after all (with why)."""
    progs = [getattr(sp, k) for sp in (stage_programs.values() if isinstance(stage_programs, dict)
                                       else stage_programs) if hasattr(sp, "f") for k in ("f", "i", "w", "b")]
    done = [p for p in progs if p.compile_s is not None]
    failed = [p for p in progs if p.compile_failure is not None]
    text = (f"compiled {len(done)} program(s) in {sum(p.compile_s for p in done):.1f} s ("
            + ", ".join(f"{p.compiled_as} {p.compile_s:.1f}" for p in done) + ")")
    if failed:
        text += "; op by op: " + "; ".join(f"{p.compiled_as} ({p.compile_failure})" for p in failed)
    return text


def inductor_output() -> str:
    """Where Inductor writes the generated code and its on-disk cache (``TORCHINDUCTOR_CACHE_DIR``
    moves it)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return cache_dir()
