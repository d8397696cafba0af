"""Run a function on N gloo ranks (spawned processes, FileStore rendezvous, one thread each).

For tests and benchmarks: ``run_ranks(fn, world, *args)`` returns every rank's result.

The parent collects every rank's result or traceback and kills all ranks when one fails or
the deadline passes, so a test never hangs.
"""
from __future__ import annotations

import os
import pickle
import tempfile
import time
import traceback
from datetime import timedelta

import torch.multiprocessing as mp


def _worker(rank, world, store_path, fn, args, result_dir, timeout_s):
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    out = os.path.join(result_dir, f"rank{rank}.pkl")
    try:
        store = dist.FileStore(store_path, world)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout_s))
        result = fn(rank, world, *args)
        with open(out, "wb") as fh:
            pickle.dump(("ok", result), fh)
        dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        with open(out, "wb") as fh:
            pickle.dump(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"), fh)
        os._exit(1)


def run_ranks(fn, world: int, *args, timeout_s: float = 30.0, deadline_s: float = 240.0, expect_failure=False):
    """Run fn(rank, world, *args) on `world` ranks; return the per-rank results (or errors)."""
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        store_path = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_worker, args=(r, world, store_path, fn, args, tmp, timeout_s))
                 for r in range(world)]
        for p in procs:
            p.start()
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
