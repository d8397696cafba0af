"""X2: per-rank training-state memory of ZeRO-3 at dp=4 against no sharding at dp=1.

    python benchmarks/zero_memory.py            # --layers 4 --d-model 128 --heads 4 --seq 64 --batch 16
    python benchmarks/zero_memory.py --dp 2

Model: ``autopar.examples.gpt`` (seeded, fp32, AdamW). Runs, each a fresh set of spawned gloo
processes (one thread each): dp=1 (one process, nothing to shard), dp=N with ZeRO-3 and, for
context, dp=N with ZeRO-2. Each trains 2 steps of one global batch (m=1 per replica).

Measured per rank, right before the optimizer's step of step 2 (gradients reduced, optimizer
states already created by step 1), as distinct tensor storages:
  params     whole parameters this rank holds + its fp32 shards (ZeRO: ``master``) + the
             resident group (norms, biases, kept whole under ZeRO-3)
  grads      gradients (ZeRO-2/3: of the shards only)
  optimizer  the optimizer's state tensors (AdamW: exp_avg, exp_avg_sq; ZeRO: of the shards)
  buffers    ZeRO-3's two preallocated gather buffers (reported apart, as X2 allows them)
and the step's peak of live tensor bytes (``runtime/memory_probe.PeakTensorMemory``, step 2),
which also holds activations and the flat gradient buffers of the groups still accumulating.

Target (X2): ZeRO-3 params + grads + optimizer at dp=N <= 30% of dp=1's, plus the two gather
buffers. Prints both and PASS/FAIL; exit code 0 when the runs completed.
"""
from __future__ import annotations

import argparse
import functools
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
os.environ.setdefault("OMP_NUM_THREADS", "1")

from autopar.runtime.spawn import run_ranks  # noqa: E402
from benchmarks.memory_model import add_model_args, model_kwargs  # noqa: E402

TARGET = 0.30
KiB = 1024


def _rank_main(rank, world, cfg):
    import torch

    import autopar
    from autopar.examples.gpt import make_gpt
    from autopar.runtime.memory_probe import PeakTensorMemory, storage_bytes

    model, inputs, target, loss_fn = make_gpt(**cfg["model"])
    opt = functools.partial(torch.optim.AdamW, lr=1e-3)
    plan = autopar.Plan(dp=world, schedule="1f1b", num_microbatches=1, zero=cfg["zero"])
    pm = autopar.parallelize(model, inputs, loss_fn=loss_fn, optimizer=opt, plan=plan, example_target=target)
    sharded = pm.built.parallelisms["dp"].storage
    # pm.optimizer is a torch Optimizer at every ZeRO level; a wrapper's state is its inner optimizer's
    inner = pm.optimizer
    trained = list(pm.built.params.values()) + (sharded.masters() if sharded is not None else [])
    snap = {}

    def measured_step(original=pm.optimizer.step):
        snap["params"] = storage_bytes(p.data for p in trained if p.data.numel())
        snap["grads"] = storage_bytes(p.grad for p in trained if p.grad is not None)
        snap["optimizer"] = storage_bytes(t for st in inner.state.values() for t in st.values()
                                          if isinstance(t, torch.Tensor) and t.dim() > 0)
        snap["buffers"] = storage_bytes(sharded.buffers) if sharded is not None else 0
        original()

    pm.step(inputs, target)
    pm.optimizer.step = measured_step
    baseline = [p.data for p in trained] + [p.grad for p in trained if p.grad is not None] + \
        [t for st in inner.state.values() for t in st.values() if isinstance(t, torch.Tensor)]
    with PeakTensorMemory(baseline) as probe:
        pm.step(inputs, target)
    snap["peak"] = probe.peak_bytes
    snap["gathers"] = sharded.gathers if sharded is not None else 0
    snap["overflow"] = sharded.overflow_gathers if sharded is not None else 0
    return snap


def _parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dp", type=int, default=4)
    add_model_args(ap, layers=4)
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = _parse(argv)
    if args.batch % args.dp:
        raise SystemExit(f"--batch {args.batch} must be divisible by --dp {args.dp}")
    model = model_kwargs(args)
    runs = [("dp=1", 1, 0), (f"dp={args.dp} ZeRO-3", args.dp, 3), (f"dp={args.dp} ZeRO-2", args.dp, 2)]
    rows = []
    for label, world, zero in runs:
        print(f"running {label} on {world} process(es) ...", file=sys.stderr, flush=True)
        per_rank = run_ranks(_rank_main, world, dict(model=model, zero=zero), deadline_s=600)
        rows.append((label, per_rank))
    base = rows[0][1][0]
    base_state = base["params"] + base["grads"] + base["optimizer"]
    print(f"examples/gpt {args.layers} layers, d_model {args.d_model}, vocab {args.vocab}, seq {args.seq}, "
          f"global batch {args.batch}; bytes per rank in KiB")
    print(f"{'run':<14} {'rank':>4} {'params':>9} {'grads':>9} {'optim':>9} {'state':>9} {'/dp=1':>7} "
          f"{'buffers':>8} {'peak':>9} {'gathers':>7}")
    verdict = True
    for label, per_rank in rows:
        for r, s in enumerate(per_rank):
            state = s["params"] + s["grads"] + s["optimizer"]
            ratio = state / base_state
            print(f"{label:<14} {r:>4} {s['params'] / KiB:>9.1f} {s['grads'] / KiB:>9.1f} {s['optimizer'] / KiB:>9.1f} "
                  f"{state / KiB:>9.1f} {ratio:>7.3f} {s['buffers'] / KiB:>8.1f} {s['peak'] / KiB:>9.1f} "
                  f"{s['gathers']:>7}")
            if "ZeRO-3" in label:
                verdict &= state <= TARGET * base_state + s["buffers"]
                verdict &= s["overflow"] == 0
    z3 = rows[1][1]
    worst = max(s["params"] + s["grads"] + s["optimizer"] for s in z3)
    print(f"\nX2: ZeRO-3 at dp={args.dp}: worst rank holds {worst / base_state:.1%} of dp=1's parameter + gradient + "
          f"optimizer bytes (target <= {TARGET:.0%}), plus {z3[0]['buffers'] / KiB:.1f} KiB of gather buffers: "
          f"{'PASS' if verdict else 'FAIL'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
