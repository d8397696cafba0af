"""Stage programs compiled by Inductor (``Plan(compile=True)``).

Each F, I, W and B program is an FX graph of aten ops (passes/split_backward.py); with
``compile`` on, the runtime calls ``torch.compile(program.gm, backend="inductor",
dynamic=False)`` in its place: C++/OpenMP kernels on CPU, Triton on GPU, element-wise chains
(the backward's values made again included) fused into the kernels that read them. The
GraphModule is compiled as the graph it is: Dynamo traces its generated code (aten calls,
nothing to guess), AOTAutograd sees an inference graph (the runtime runs programs under
``no_grad``), and Inductor's on-disk cache answers a program it compiled before, in this
process or an earlier one (identical stages included).

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

Compile time is paid at a program's first call (Dynamo compiles lazily); the log reports it per
program and the program keeps it (``Program.compile_s``; ``compile_report`` sums them).
"""
from __future__ import annotations

import dataclasses
import logging
import time

import torch

log = logging.getLogger("autopar")

_COMPILED = "_autopar_compiled"  # attribute of the GraphModule: (its code when compiled, the compiled callable)


def compiled_executable(program, accumulate: tuple[int, ...]) -> object:
    """``fn(args: list)`` running ``program`` compiled (see the module docstring); the results at
    ``accumulate`` are added into the extra trailing arguments, which then stand for them. The
    first (compiling) call's seconds go to ``program.compile_s`` and the log."""
    gm = program.gm
    entry = gm.__dict__.get(_COMPILED)
    if entry is None or entry[0] is not gm.code:
        entry = gm.__dict__[_COMPILED] = (gm.code, torch.compile(gm, backend="inductor", dynamic=False))
    compiled = entry[1]
    n = len(program.args)
    first = [True]

    def fn(args: list):
        into = args[n:]
        if first[0]:
            t0 = time.perf_counter()
            outs = list(compiled(*args[:n]))
            program.compile_s = (program.compile_s or 0.0) + time.perf_counter() - t0
            log.info("autopar: compiled %s in %.2f s (its first call)", program.compiled_as, program.compile_s)
            first[0] = False
        else:
            outs = list(compiled(*args[:n]))
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
