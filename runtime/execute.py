"""Running one stage program (passes/program.Program) on a microbatch env and the shared state.

A program's GraphModule is compiled for execution once (passes/exec_code.py: peepholes, ops
bound to their C++ entry points, the boxed calling convention) and cached per GraphModule; the
cache entry is rebuilt when the module is recompiled. The GraphModule itself is never changed
here, so what ``pm.dump`` prints and the analyses read stays the graph as split.
"""
from __future__ import annotations

import torch

from autopar.passes.exec_code import compile_for_execution
from autopar.passes.program import Program

_CACHE = "_autopar_executable"  # attribute of the GraphModule: (its code when compiled, {accumulate: fn})


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
    if keep is None:
        args = [env[k] if k in env else state[k] for k in program.args]
    else:
        args = [(env[k] if k in keep else env.pop(k)) if k in env else state[k] for k in program.args]
    if accumulate:
        args += into
    fn = executable(program, accumulate, tuple(t.dtype for t in into) if accumulate else ())
    # The programs are already forward+backward: autograd must not record them again (it
    # would cost time and keep I's intermediates alive through the gradients it returns).
    with torch.no_grad():
        outs = fn(args)
    env.update(zip(program.results, outs))


def executable(program: Program, accumulate: tuple[str, ...] = (), into_dtypes: tuple = ()):
    """The program compiled for running: ``fn(args: list)``, boxed; the results named in
    ``accumulate`` are added into extra trailing arguments of ``into_dtypes`` (default: each
    result's own dtype). Rebuilt if the GraphModule was recompiled."""
    gm = program.gm
    code = gm.code
    entry = gm.__dict__.get(_CACHE)
    if entry is None or entry[0] is not code:
        entry = gm.__dict__[_CACHE] = (code, {})
    fn = entry[1].get((accumulate, into_dtypes))
    if fn is None:
        index = {k: i for i, k in enumerate(program.results)}
        fn = entry[1][accumulate, into_dtypes] = compile_for_execution(
            gm, tuple(index[k] for k in accumulate), into_dtypes or None)
    return fn


def executed_code(program: Program) -> str:
    """The source of what ``run`` executes (passes/exec_code.py), without accumulation."""
    return executable(program).__func__.__autopar_source__
