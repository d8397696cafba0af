"""U5: Muon against AdamW under dp=2 ZeRO-1 on 2 gloo processes: optimizer-step time and bytes
communicated per step, in the same run.

    python benchmarks/muon.py            # --layers 4 --d-model 256 --heads 4 --seq 64 --batch 16 --steps 4

Model: ``autopar.examples.gpt`` (seeded, fp32). Both optimizers train the same model on the same
2 processes, one after the other: ``torch.optim.AdamW`` (the peer: every parameter in one
ZeRO-1 flat set, packed) and ``autopar.Muon`` (its hidden matrices in a Muon set whose shards
hold whole matrices, passes/zero_layout.aligned_offsets; the rest under AdamW).

Measured per rank, over the last ``steps - 1`` steps (step 1 creates the optimizer state):
  step ms    the median wall time of ``pm.optimizer.step()`` (the ZeRO-1 step: this replica's
             shards stepped, then the all-gather of the parameters; Muon's Newton-Schulz runs
             on the matrices of its own shard only)
  bytes      bytes every collective of one training step moved (the gradients'
             reduce-scatter, the parameters' all-gather, the gradient norm's all-reduce:
             counted at the input of each call in collectives/comms.py)
  padding    elements of the flat sets that hold no parameter

Target (U5): Muon's bytes per step <= 1.25x AdamW's. Prints PASS/FAIL; exit status 1 when the
target is missed.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
os.environ.setdefault("OMP_NUM_THREADS", "1")

from autopar.runtime.spawn import run_ranks  # noqa: E402
from benchmarks.memory_model import add_model_args, model_kwargs  # noqa: E402

TARGET = 1.25


def _counting(comms, counter: dict) -> dict:
    """Count the bytes each collective of collectives/comms.py is handed (the all-gather's whole
    output, the reduce-scatter's whole input); returns the originals to put back."""
    originals = {}
    for name, arg in (("all_reduce_sum", 0), ("all_gather_flat", 0), ("reduce_scatter_sum", 1)):
        original = originals[name] = getattr(comms, name)

        def counted(*a, _original=original, _arg=arg, **k):
            t = a[_arg]
            counter["bytes"] += t.numel() * t.element_size()
            return _original(*a, **k)

        setattr(comms, name, counted)
    return originals


def _rank_main(rank, world, cfg):
    from autopar.collectives import comms

    counter = {"bytes": 0}
    originals = _counting(comms, counter)
    try:
        return _compare(world, cfg, counter)
    finally:
        for name, fn in originals.items():
            setattr(comms, name, fn)


def _compare(world, cfg, counter):
    import functools

    import torch

    import autopar
    from autopar.examples.gpt import make_gpt

    out = {}
    for label, factory in (("AdamW", functools.partial(torch.optim.AdamW, lr=3e-4, betas=(0.9, 0.95))),
                           ("Muon", autopar.Muon(lr=0.02, adamw_lr=3e-4))):
        model, inputs, target, loss_fn = make_gpt(**cfg["model"])
        pm = autopar.parallelize(model, inputs, loss_fn=loss_fn, optimizer=factory, example_target=target,
                                 plan=autopar.Plan(dp=world, num_microbatches=2, zero=1), timeout=120)
        times, sent = [], []
        original = pm.optimizer.step

        def timed(original=original):
            t0 = time.perf_counter()
            original()
            times.append(time.perf_counter() - t0)

        pm.optimizer.step = timed
        for _ in range(cfg["steps"]):
            counter["bytes"] = 0
            pm.step(inputs, target)
            sent.append(counter["bytes"])
        sets = pm.optimizer.sets
        out[label] = {"step_ms": 1e3 * statistics.median(times[1:]), "bytes": statistics.median(sent[1:]),
                      "padding": sum(s.total - sum(p.numel() for f in s.names for p in [pm.built.params[f]])
                                     for s in sets),
                      "elements": sum(s.total for s in sets)}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(ap, layers=4, d_model=256)
    ap.add_argument("--steps", type=int, default=4)
    args = ap.parse_args(argv)
    if args.steps < 2:
        raise SystemExit(f"--steps {args.steps}: at least 2 (step 1 creates the optimizer state)")
    print("running AdamW and Muon under dp=2 ZeRO-1 on 2 processes ...", file=sys.stderr, flush=True)
    per_rank = run_ranks(_rank_main, 2, dict(model=model_kwargs(args), steps=args.steps), deadline_s=900)
    print(f"examples/gpt {args.layers} layers, d_model {args.d_model}, vocab {args.vocab}, seq {args.seq}, "
          f"global batch {args.batch}; dp=2 ZeRO-1, medians of steps 2..{args.steps}")
    print(f"{'optimizer':<10} {'rank':>4} {'step ms':>9} {'bytes/step':>12} {'flat elements':>14} {'padding':>8}")
    for label in ("AdamW", "Muon"):
        for r, res in enumerate(per_rank):
            x = res[label]
            print(f"{label:<10} {r:>4} {x['step_ms']:>9.2f} {x['bytes']:>12,.0f} {x['elements']:>14,} "
                  f"{x['padding']:>8,}")
    byte_ratio = max(res["Muon"]["bytes"] / res["AdamW"]["bytes"] for res in per_rank)
    time_ratio = max(res["Muon"]["step_ms"] / res["AdamW"]["step_ms"] for res in per_rank)
    print(f"\nU5: Muon / AdamW bytes per step {byte_ratio:.3f}x (target <= {TARGET}x), optimizer step time "
          f"{time_ratio:.2f}x: {'PASS' if byte_ratio <= TARGET else 'FAIL'}")
    return 0 if byte_ratio <= TARGET else 1


if __name__ == "__main__":
    raise SystemExit(main())
