"""Run a function on N gloo (or NCCL) ranks (spawned processes, FileStore rendezvous, one thread each).

For tests and benchmarks: ``run_ranks(fn, world, *args)`` returns every rank's result, in
processes started for that one call; ``RankPool(world).run(fn, *args)`` does the same in
processes that stay up between calls (one process group; what a process imported, compiled or
memoized stays), so many short runs don't each pay for process start and imports.

The parent collects every rank's result or traceback and kills all ranks when one fails or
the deadline passes, so a test never hangs (a pool is closed then, and the next call starts a
fresh one).
"""
from __future__ import annotations

import os
import pickle
import tempfile
import time
import traceback
from datetime import timedelta

import torch.multiprocessing as mp


def _join(rank, world, store_path, timeout_s, backend: str = "gloo"):
    """One intra-op thread, and this process in the group (FileStore rendezvous). ``"nccl"``:
    rank r on GPU r."""
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    kw = {}
    if backend == "nccl":
        torch.cuda.set_device(rank)
        kw["device_id"] = torch.device("cuda", rank)
    dist.init_process_group(backend, store=dist.FileStore(store_path, world), rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s), **kw)


def _worker(rank, world, store_path, fn, args, result_dir, timeout_s, backend="gloo"):
    import torch.distributed as dist

    out = os.path.join(result_dir, f"rank{rank}.pkl")
    try:
        _join(rank, world, store_path, timeout_s, backend)
        result = fn(rank, world, *args)
        with open(out, "wb") as fh:
            pickle.dump(("ok", result), fh)
        dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        with open(out, "wb") as fh:
            pickle.dump(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"), fh)
        os._exit(1)


def _pool_worker(rank, world, store_path, conn, timeout_s):
    import torch.distributed as dist

    try:
        _join(rank, world, store_path, timeout_s)
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        os._exit(1)
    conn.send(("ok", "ready"))
    while True:
        try:
            task = conn.recv()
        except EOFError:  # the parent is gone
            os._exit(0)
        if task is None:
            break
        fn, args = task
        try:
            reply = ("ok", fn(rank, world, *args))
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            reply = ("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
        try:
            conn.send(reply)
        except Exception as e:  # noqa: BLE001 - an unpicklable result
            conn.send(("error", f"rank {rank}'s result cannot be sent: {type(e).__name__}: {e}"))
    dist.destroy_process_group()
    conn.close()


class RankPool:
    """``world`` gloo processes that stay up: ``run(fn, *args)`` runs ``fn(rank, world, *args)``
    on every rank and returns the results, like ``run_ranks``. After a failure or a missed
    deadline the processes are killed and the pool is closed (``closed``)."""

    def __init__(self, world: int, timeout_s: float = 30.0, start_s: float = 120.0):
        ctx = mp.get_context("spawn")
        self.world, self.closed = world, False
        self._tmp = tempfile.TemporaryDirectory()
        store = os.path.join(self._tmp.name, "store")
        self._conns, self._procs = [], []
        for r in range(world):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_pool_worker, args=(r, world, store, child, timeout_s), daemon=True)
            p.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(p)
        self._collect(start_s, "start")

    def _collect(self, deadline_s: float, what: str) -> list:
        end = time.monotonic() + deadline_s
        replies: list = [None] * self.world
        failed_at = None
        while any(r is None for r in replies):
            now = time.monotonic()
            if now > end or (failed_at is not None and now > failed_at + 2.0):  # peers of a failed rank: 2 s
                break
            for r, c in enumerate(self._conns):
                if replies[r] is None:
                    if c.poll(0.02):
                        try:
                            replies[r] = c.recv()
                        except EOFError:
                            replies[r] = ("error", f"rank {r} died (exit code {self._procs[r].exitcode})")
                    elif not self._procs[r].is_alive():
                        replies[r] = ("error", f"rank {r} died (exit code {self._procs[r].exitcode})")
                    if replies[r] is not None and replies[r][0] != "ok" and failed_at is None:
                        failed_at = time.monotonic()
        hung = [r for r, x in enumerate(replies) if x is None]
        errors = [f"--- rank {r}: {x[1]}" for r, x in enumerate(replies) if x is not None and x[0] != "ok"]
        if hung or errors:
            self.close(kill=True)
            raise AssertionError(f"{what}: ranks still running at the deadline: {hung}\n" + "\n".join(errors))
        return [x[1] for x in replies]

    def run(self, fn, *args, deadline_s: float = 240.0) -> list:
        if self.closed:
            raise RuntimeError("this RankPool is closed (a run failed or it was closed)")
        for c in self._conns:
            c.send((fn, args))
        return self._collect(deadline_s, getattr(fn, "__name__", "run"))

    def close(self, kill: bool = False) -> None:
        if self.closed:
            return
        self.closed = True
        for c, p in zip(self._conns, self._procs):
            if not kill and p.is_alive():
                try:
                    c.send(None)
                except OSError:
                    pass
        for p in self._procs:
            p.join(timeout=0 if kill else 10)
            if p.is_alive():
                p.kill()
                p.join()
        for c in self._conns:
            c.close()
        self._tmp.cleanup()


def run_ranks(fn, world: int, *args, timeout_s: float = 30.0, deadline_s: float = 240.0, expect_failure=False,
              hash_seeds: list[str] | None = None, backend: str = "gloo"):
    """Run fn(rank, world, *args) on `world` ranks; return the per-rank results (or errors).
    ``backend="nccl"``: one GPU per rank (benchmarks/gpu_check.py).
    ``hash_seeds``: each rank's ``PYTHONHASHSEED`` (default: whatever this process passes on;
    unset, each process draws its own, as under torchrun: the build aligns their graphs)."""
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        store_path = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_worker, args=(r, world, store_path, fn, args, tmp, timeout_s, backend))
                 for r in range(world)]
        before = os.environ.get("PYTHONHASHSEED")
        try:
            for r, p in enumerate(procs):
                if hash_seeds is not None:  # a spawned interpreter reads it when it starts
                    os.environ["PYTHONHASHSEED"] = str(hash_seeds[r])
                p.start()
        finally:
            if before is None:
                os.environ.pop("PYTHONHASHSEED", None)
            else:
                os.environ["PYTHONHASHSEED"] = before
        end = time.monotonic() + deadline_s
        while time.monotonic() < end and any(p.is_alive() for p in procs):
            time.sleep(0.05)
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()
        results = []
        for r in range(world):
            path = os.path.join(tmp, f"rank{r}.pkl")
            if os.path.exists(path):
                with open(path, "rb") as fh:
                    results.append(pickle.load(fh))
            else:
                results.append(("missing", f"rank {r} left no result (exit code {procs[r].exitcode})"))
    if expect_failure:
        return results
    errors = [f"--- rank {r}: {msg}" for r, (status, msg) in enumerate(results) if status != "ok"]
    if hung or errors:
        raise AssertionError(f"ranks still running at the deadline: {hung}\n" + "\n".join(map(str, errors)))
    return [res for _status, res in results]
