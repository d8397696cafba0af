"""A1: a pipeline rank's peak memory must not grow with the microbatch count.

    python benchmarks/memory_vs_microbatches.py      # --d-model 256 --seq 256 --batch 2 -m 4,8,16,32
    python benchmarks/memory_vs_microbatches.py --schedules 1f1b --m 4,32

Model: ``autopar.examples.gpt`` (seeded, fp32, AdamW; the size flags of the other benchmarks,
``memory_model.add_model_args``), pp=2 on 2 gloo processes, a FIXED microbatch size: here
``--batch`` is the samples of one microbatch, and the global batch is ``batch * m``, so only the
number of microbatches changes. Per schedule and m, the
second step (AdamW's states exist by then) runs inside
``autopar.runtime.memory_probe.PeakTensorMemory``: the peak of live tensor bytes on each
rank (its parameters, gradients and AdamW states at entry, plus every storage an ATen op
makes during the step, minus each one freed; module docstring of memory_probe). Printed per
rank: the peak at each m, the ratio to the peak at ``--base`` microbatches (default 8), the
most sends the rank held at once (``DistributedPipeline.max_sends_held``), and one boundary
tensor's bytes (what each extra microbatch cost per boundary when the runtime held every send
until the end of the step).

Target (A1): the peak at the largest m within 5% of the peak at ``--base`` for every schedule
listed. 1f1b and zb-h1 hold at most p microbatches' activations; zbv holds up to p
microbatches per rank over its two chunks for every m >= 2p (its in-flight frontier is
reached in the warm-up and stays flat), so it gets the same 5%. Exit status 1 when a row
misses the target.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
os.environ.setdefault("OMP_NUM_THREADS", "1")

from autopar.runtime.spawn import run_ranks  # noqa: E402
from benchmarks.memory_model import add_model_args, model_kwargs  # noqa: E402

MAX_GROWTH = 0.05
MiB = 2.0 ** 20


def _rank_main(rank, world, cfg):
    import functools
    import gc

    import torch

    import autopar
    from autopar.examples.gpt import make_gpt
    from autopar.runtime.memory_probe import PeakTensorMemory
    from benchmarks.memory_model import state_tensors

    torch.set_num_threads(1)
    out = []
    for schedule, m in cfg["runs"]:
        mk = cfg["model_kwargs"]
        model, inputs, target, loss_fn = make_gpt(**{**mk, "batch_size": mk["batch_size"] * m})
        pm = autopar.parallelize(model, inputs, loss_fn=loss_fn,
                                 optimizer=functools.partial(torch.optim.AdamW, lr=1e-4), example_target=target,
                                 plan=autopar.Plan(pp=2, schedule=schedule, num_microbatches=m))
        pm.step(inputs, target)
        gc.collect()
        probe = PeakTensorMemory([t for ts in state_tensors(pm).values() for t in ts])
        with probe:
            pm.step(inputs, target)
        ex = pm.built.executor
        wires = list(ex._out_wires.values()) or [ex._in_wires[s] for s in ex.my_stages]
        boundary = max(sum(torch.Size(w.shape).numel() * w.dtype.itemsize for w in ws.values()) for ws in wires)
        out.append({"peak": probe.peak_bytes, "held": ex.max_sends_held, "boundary": boundary})
        del pm, model, ex
        gc.collect()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_args(ap, layers=4, d_model=256, heads=4, seq=256, batch=2, vocab=256)  # --batch: one microbatch
    ap.add_argument("-m", "--m", default="4,8,16,32", help="microbatch counts, comma-separated")
    ap.add_argument("--base", type=int, default=8, help="the m the largest m is compared with")
    ap.add_argument("--schedules", default="1f1b,zb-h1,zbv")
    ap.add_argument("--deadline", type=float, default=900.0)
    args = ap.parse_args(argv)
    ms = sorted({int(x) for x in args.m.split(",")} | {args.base})
    scheds = [s.strip() for s in args.schedules.split(",") if s.strip()]
    runs = [(s, m) for s in scheds for m in ms]
    print(f"memory_vs_microbatches: gpt {args.layers} layers, d_model {args.d_model}, seq {args.seq}, microbatch "
          f"{args.batch} samples, pp=2 on 2 gloo ranks; peak live tensor bytes of the second step "
          f"(runtime.memory_probe)", flush=True)
    t0 = time.perf_counter()
    cfg = dict(runs=runs, model_kwargs=model_kwargs(args))
    ranks = run_ranks(_rank_main, 2, cfg, deadline_s=args.deadline)
    print(f"ran {len(runs)} plans x 2 steps in {time.perf_counter() - t0:.1f} s", flush=True)
    ok = True
    for s in scheds:
        print(f"\n[{s}]  target: peak at m={ms[-1]} within {MAX_GROWTH:.0%} of the peak at m={args.base}")
        print(f"  {'rank':>4}  " + "  ".join(f"{'m=' + str(m):>9}" for m in ms) + f"  {'ratio':>6}  "
              f"{'sends held':>10}  {'boundary MiB':>12}")
        for r in range(2):
            rows = {m: ranks[r][runs.index((s, m))] for m in ms}
            ratio = rows[ms[-1]]["peak"] / rows[args.base]["peak"]
            good = ratio <= 1 + MAX_GROWTH
            ok &= good
            print(f"  {r:>4}  " + "  ".join(f"{rows[m]['peak'] / MiB:>9.2f}" for m in ms) + f"  {ratio:>6.3f}  "
                  f"{'/'.join(str(rows[m]['held']) for m in ms):>10}  {rows[ms[-1]]['boundary'] / MiB:>12.3f}  "
                  f"{'PASS' if good else 'FAIL'}")
    print(f"\nA1: {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
