"""Running one stage program (passes/program.Program) on a microbatch env and the shared state.

A program's GraphModule is compiled for execution once (passes/exec_code.py: peepholes, ops
bound to their C++ entry points, the boxed calling convention) and cached per GraphModule; the
cache entry is rebuilt when the module is recompiled. The GraphModule itself is never changed
here, so what ``pm.dump`` prints and the analyses read stays the graph as split.
"""
from __future__ import annotations

import inspect
import logging

import torch

from autopar.passes.exec_code import compile_for_execution
from autopar.passes.moe_dispatch import IN_FLIGHT_OPS
from autopar.passes.program import Program

from .compiled import compiled_executable

_CACHE = "_autopar_executable"  # attribute of the GraphModule: (its code when compiled, {accumulate: fn})
_COMPILED_FNS = "_autopar_compiled_fns"  # attribute of the GraphModule: {(accumulate, dtypes): compiled fn}
log = logging.getLogger("autopar")


def run(program: Program, env: dict, state: dict, accumulate: tuple[str, ...] = (), into: list | None = None,
        keep: frozenset[str] | None = None) -> None:
    """Read the program's args from the microbatch env (or the shared state for parameters,
    buffers and constants), run it, and store its results in env under their keys.

    ``accumulate``/``into``: result keys and, in the same order, tensors to add those results
    into in place (gradient accumulation over microbatches); env then holds each accumulator
    under its key.
    ``keep``: the env keys later programs of this microbatch still read; the others that this
    program reads are taken out of env, so each is freed inside the program right after its
    last use (None: env keeps everything).
    """
    args, fn = _prepare(program, env, state, accumulate, into, keep, pausing=False)
    # The programs are already forward+backward: autograd must not record them again (it
    # would cost time and keep I's intermediates alive through the gradients it returns).
    with torch.no_grad():
        outs = fn(args)
    env.update(zip(program.results, outs))


def _prepare(program, env, state, accumulate, into, keep, pausing: bool):
    if keep is None:
        args = [env[k] if k in env else state[k] for k in program.args]
    else:
        args = [(env[k] if k in keep else env.pop(k)) if k in env else state[k] for k in program.args]
    if accumulate:
        args += into
    fn = executable(program, accumulate, tuple(t.dtype for t in into) if accumulate else (), pausing)
    return args, fn


def start(program: Program, env: dict, state: dict, accumulate: tuple[str, ...] = (), into: list | None = None,
          keep: frozenset[str] | None = None):
    """``run`` as a generator: it pauses after every op that leaves communication in flight
    (the MoE dispatch chains' start and middle ops, passes/moe_dispatch.py) and stores the
    results in env when it is exhausted. For ``run_paired``."""
    args, fn = _prepare(program, env, state, accumulate, into, keep, pausing=True)
    with torch.no_grad():
        gen = fn(args)
    if not inspect.isgenerator(gen):  # nothing in flight in this program: it ran whole
        env.update(zip(program.results, gen))
        return
    while True:
        with torch.no_grad():
            try:
                next(gen)
            except StopIteration as done:
                env.update(zip(program.results, done.value))
                return
        yield


def pauses(stage_programs) -> bool:
    """Whether any F, I or B of these stage programs leaves communication in flight (a MoE
    dispatch chain): only then does interleaving an F&B unit's halves hide anything."""
    return any(n.op == "call_function" and n.target in IN_FLIGHT_OPS
               for sp in stage_programs for prog in (sp.f, sp.i, sp.b) for n in prog.gm.graph.nodes)


def run_paired(first, second) -> None:
    """Run two ``start`` generators (an F&B unit's two programs) to the end, alternating at their
    pauses: while one's all-to-all is in flight, the other computes. The order is fixed by the
    programs alone, so every rank of a group issues its collectives in the same order."""
    live = [first, second]
    while live:
        for gen in list(live):
            try:
                next(gen)
            except StopIteration:
                live.remove(gen)


def executable(program: Program, accumulate: tuple[str, ...] = (), into_dtypes: tuple = (), pausing: bool = False):
    """The program compiled for running: ``fn(args: list)``, boxed; the results named in
    ``accumulate`` are added into extra trailing arguments of ``into_dtypes`` (default: each
    result's own dtype); ``pausing``: a generator function (``start``). Rebuilt if the
    GraphModule was recompiled. A program marked ``compiled_as`` runs Inductor's code
    (runtime/compiled.py) unless it pauses."""
    if program.compiled_as is not None and not pausing:
        return _compiled(program, accumulate, into_dtypes)
    return _op_by_op(program, accumulate, into_dtypes, pausing)


def _op_by_op(program: Program, accumulate: tuple[str, ...], into_dtypes: tuple, pausing: bool):
    gm = program.gm
    code = gm.code
    entry = gm.__dict__.get(_CACHE)
    if entry is None or entry[0] is not code:
        entry = gm.__dict__[_CACHE] = (code, {})
    fn = entry[1].get((accumulate, into_dtypes, pausing))
    if fn is None:
        index = {k: i for i, k in enumerate(program.results)}
        fn = entry[1][accumulate, into_dtypes, pausing] = compile_for_execution(
            gm, tuple(index[k] for k in accumulate), into_dtypes or None, IN_FLIGHT_OPS if pausing else ())
    return fn


def executed_code(program: Program) -> str:
    """The source of what ``run`` executes op by op (passes/exec_code.py), without accumulation."""
    return _op_by_op(program, (), (), False).__func__.__autopar_source__


def _compiled(program: Program, accumulate: tuple[str, ...], into_dtypes: tuple):
    """Inductor's code for ``program`` (runtime/compiled.py), falling back to op by op for good
    when its compilation fails (logged once, with the reason)."""
    key = ("compiled", accumulate, into_dtypes)
    cache = program.gm.__dict__.setdefault(_COMPILED_FNS, {})
    fn = cache.get(key)
    if fn is not None:
        return fn
    index = {k: i for i, k in enumerate(program.results)}
    inner = compiled_executable(program, tuple(index[k] for k in accumulate))
    eager = _op_by_op(program, accumulate, into_dtypes, False)

    def fn(args: list):  # (executable() looks the cache up per run: after a fallback it returns eager)
        try:
            return inner(args)
        except Exception as e:  # noqa: BLE001 - Inductor's failure on this graph: run it op by op, say why
            if not args:  # the compiled call had started on the arguments it takes over: nothing to rerun
                raise
            why = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
            log.warning("autopar: %s runs op by op: Inductor cannot compile it: %s: %s", program.compiled_as,
                        type(e).__name__, why)
            program.compile_failure = f"{type(e).__name__}: {why}"
            cache[key] = eager
            return eager(args)

    cache[key] = fn
    return fn
