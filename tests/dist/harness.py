"""Test helpers for the multi-process tests (the spawn runners are ``autopar.runtime.spawn``).

``run_shared(fn, world, *args)`` runs ``fn(rank, world, *args)`` on the session's pool of
``world`` gloo processes (started on first use, closed at exit; a failed run closes it and the
next run starts a fresh one). Each run starts clean: the memoizing wrappers below are off
unless the run asks for them (``reuse``, the default), and the process groups a run created are destroyed after it. What
survives between runs is what makes sharing worth it: imports, and the memo of captures and
split programs for the runs that use them. Not for runs with context or expert parallelism
(``reuse=False``): their captures hold the names of process groups, which are destroyed after
each run. Runs that kill a rank or must see a fresh process use ``run_ranks``.
"""
import atexit
import contextlib
import importlib
import io

_POOLS: dict = {}
_CAPTURES: dict = {}   # memoized_capture's memo, kept across the runs of one process
_PROGRAMS: dict = {}   # reuse_programs' memo
_ORIGINAL: dict = {}   # the functions the wrappers replace


def run_shared(fn, world: int, *args, deadline_s: float = 600.0, reuse: bool = True):
    """``fn(rank, world, *args)`` on the session's ``world`` processes; ``reuse``: with
    captures and split programs memoized (reuse_captures) across the runs that reuse."""
    from autopar.runtime.spawn import RankPool

    pool = _POOLS.get(world)
    if pool is None or pool.closed:
        pool = _POOLS[world] = RankPool(world)
    return pool.run(_clean_run, fn, args, reuse, deadline_s=deadline_s)


@atexit.register
def close_pools() -> None:
    for pool in _POOLS.values():
        pool.close()


def _clean_run(rank, world, fn, args, reuse):
    """``fn`` with the wrappers on (``reuse``) or off, and every process group it creates
    destroyed after it."""
    import torch.distributed as dist

    from autopar.collectives import comms

    passes, sb = importlib.import_module("autopar.passes"), importlib.import_module("autopar.passes.split_backward")
    if "capture" in _ORIGINAL:
        passes.capture, sb.split_backward = _ORIGINAL["capture"], _ORIGINAL["split_backward"]
    created, new_group = [], comms.new_group

    def tracked(*a, **k):
        g = new_group(*a, **k)
        created.append(g)
        return g

    comms.new_group = tracked
    if reuse:
        reuse_captures()
    try:
        return fn(rank, world, *args)
    finally:
        comms.new_group = new_group
        for g in created:
            if g is not None:
                dist.destroy_process_group(g)


def reuse_captures() -> None:
    """In this (spawned) process, capture each zoo model once per plan-independent key
    (tests/models.memoized_capture), and split each stage's backward once (reuse_programs).
    Not for passes that rewrite the capture in place."""
    from tests.models import memoized_capture

    passes = importlib.import_module("autopar.passes")
    _originals()
    if not getattr(passes.capture, "memoized", False):
        passes.capture = memoized_capture(_ORIGINAL["capture"], _CAPTURES)
    reuse_programs()


def _originals() -> None:
    if "capture" not in _ORIGINAL:
        _ORIGINAL["capture"] = importlib.import_module("autopar.passes").capture
        _ORIGINAL["split_backward"] = importlib.import_module("autopar.passes.split_backward").split_backward


def reuse_programs() -> None:
    """In this (spawned) process, split each stage's backward once per stage content: a stage
    with the same graph, names, placeholder shapes/dtypes/strides, gradient flags and fake mode
    gets the same F/I/W/B programs (split_backward is deterministic and its programs are only
    read afterwards: exec_code peepholes a copy). Schedules that cut the model alike (every
    one-stage-per-rank schedule of a pp) then trace the joint graph once instead of per plan."""
    sb = importlib.import_module("autopar.passes.split_backward")  # the package re-exports the function
    _originals()
    if getattr(sb.split_backward, "memoized", False):
        return
    split, memo = _ORIGINAL["split_backward"], _PROGRAMS

    def memoized(stage, input_requires_grad, trainable=None, recompute=False, remake=True):
        vals = [n.meta.get("val") for n in stage.gm.graph.nodes if n.op == "placeholder"]
        key = (stage.index, stage.gm.code, stage.params, stage.buffers, stage.constants, stage.data, stage.inputs,
               stage.outputs, stage.buffer_updates, stage.has_loss,
               tuple((tuple(v.shape), v.dtype, tuple(v.stride()), id(getattr(v, "fake_mode", None))) for v in vals),
               tuple(sorted(input_requires_grad.items())),
               None if trainable is None else frozenset(trainable), recompute, remake)
        if key not in memo:
            memo[key] = (split(stage, input_requires_grad, trainable, recompute=recompute, remake=remake),
                         vals)  # vals: ids stay taken
        return memo[key][0]

    memoized.memoized = True
    sb.split_backward = memoized


def run_pooled(script: str, args: list[str], deadline_s: float = 120.0) -> str:
    """``benchmarks/<script>``'s ``main(args)`` in this process, its ranks on this session's shared
    pool of gloo processes (``tests/dist/harness.run_shared``: started and imported once, not per
    script) instead of freshly spawned ones; returns what it printed. It must return 0."""
    from autopar.runtime import spawn
    mod = importlib.import_module("benchmarks." + script.removesuffix(".py"))  # a module the ranks can import

    def pooled(fn, world, *a, timeout_s=None, deadline_s=deadline_s, expect_failure=False):
        assert not expect_failure
        return run_shared(fn, world, *a, deadline_s=min(deadline_s, limit), reuse=False)

    limit, saved = deadline_s, (spawn.run_ranks, getattr(mod, "run_ranks", None))
    spawn.run_ranks = pooled  # the scripts import it at the top or inside main
    if saved[1] is not None:
        mod.run_ranks = pooled
    buf = io.StringIO()
    try:
        with contextlib.redirect_stdout(buf):
            rc = mod.main(args)
    finally:
        spawn.run_ranks = saved[0]
        if saved[1] is not None:
            mod.run_ranks = saved[1]
    assert rc == 0, buf.getvalue()
    return buf.getvalue()
