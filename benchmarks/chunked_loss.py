"""M2 (issue 35): the chunked cross-entropy against the loss as captured, on the same machine.

    python benchmarks/chunked_loss.py      # --layers 8 --d-model 256 --heads 4 --seq 1024 --batch 8 --vocab 65536
    python benchmarks/chunked_loss.py --pp 1 --layers 2 --batch 4             # the head almost alone

Model: ``autopar.examples.gpt`` (tied embedding / LM head, ``F.cross_entropy`` on the logits),
fp32, AdamW, a 64k vocabulary, microbatches of ``--batch / --microbatches`` x ``--seq`` tokens
(4096 by default), pp=2 under 1f1b on gloo processes (one thread each): the stage cuts are the
planner's for the loss as captured (``search.price`` + ``to_plan``), the same in both runs, so
the last stage holds the head and the few blocks the balance gives it. Two runs, each in fresh
processes: ``loss_chunk_tokens=0`` (the loss as captured: the ``[tokens, vocab]`` logits, their
log-softmax and their gradient) and ``loss_chunk_tokens=C``, the planner's chunk for this
vocabulary (``linear_ce.default_chunk``; ``--chunk`` overrides).

Measured per run and rank: step 1 unobserved (AdamW creates its states); step 2 inside
``PeakTensorMemory`` (live tensor bytes: parameters, gradients and AdamW states at entry, plus
every storage an op creates, the chunked ops' own buffers included: ``probe_inside_kernels``);
then ``--steps`` timed steps (median of the slowest rank); the process's peak RSS (``ru_maxrss``:
the whole run, capture included). Predicted: the planner's ``Estimate.peak_memory`` of the
layout at those cuts (the chunked run from ``ModelProfile.chunked``), without the device's
fixed runtime overhead, which the probe does not see.

Targets (M2), on the last stage's rank: chunked / as captured <= 0.35 on the step's peak live
bytes above the parameters, gradients and optimizer states (the whole peak is printed too); the
step time ratio <= 1.10; every prediction within the memory model's bounds (|error| <= 15%,
never under by more than 5%: benchmarks/memory_model.py). Exit 1 when a target is missed
(``--no-target``: 0 whenever the run completes).
"""
from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks.memory_model import MAX_ERROR, MAX_UNDER, add_model_args, model_kwargs  # noqa: E402

MAX_MEMORY_RATIO, MAX_TIME_RATIO = 0.35, 1.10
MiB = 2 ** 20


def _run(rank, world, cfg):
    import functools
    import resource
    import statistics
    import time

    import torch

    import autopar
    from autopar.examples.gpt import make_gpt
    from autopar.runtime.memory_probe import PeakTensorMemory
    from benchmarks.memory_model import probe_inside_kernels, state_tensors

    torch.set_num_threads(1)
    model, inputs, target, loss_fn = make_gpt(**cfg["model_kwargs"])
    pm = autopar.parallelize(model, inputs, loss_fn=loss_fn, optimizer=functools.partial(torch.optim.AdamW, lr=1e-4),
                             plan=cfg["plan"], example_target=target)
    losses = [pm.step(inputs, target)]  # step 1: AdamW creates its states
    probe = PeakTensorMemory([t for ts in state_tensors(pm).values() for t in ts])
    with probe, probe_inside_kernels(probe):
        losses.append(pm.step(inputs, target))
    times = []
    for _ in range(cfg["steps"]):
        t0 = time.perf_counter()
        losses.append(pm.step(inputs, target))
        times.append(time.perf_counter() - t0)
    return {"peak": probe.peak_bytes, "baseline": probe.baseline_bytes, "step_s": statistics.median(times),
            "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "losses": [float(x) for x in losses]}


def _priced(mk: dict, pp: int, m: int, chunk: int | None):
    """[(plan, memory rows of every rank without the runtime overhead)] as captured and chunked,
    at the cuts the planner gives the loss as captured; and the chunk."""
    import dataclasses

    from autopar.examples.gpt import make_gpt
    from autopar.planner.devices import get_profile
    from autopar.planner.estimate import Evaluator, Layout
    from autopar.planner.profile import profile_model
    from autopar.planner.search import price, to_plan

    model, inputs, target, loss_fn = make_gpt(**{**mk, "batch_size": mk["batch_size"] // m})
    prof = profile_model(model, inputs, target, loss_fn, name="gpt")
    if prof.chunked is None:
        raise SystemExit("chunked_loss: the planner found no chunkable loss in examples/gpt")
    if chunk:  # the graphs do not depend on the chunk; the ops' buffers do
        last = prof.chunked.units[-1]
        prof.chunked.units[-1] = dataclasses.replace(last, kind=dataclasses.replace(last.kind, loss_chunk=chunk))
    chunk = chunk or prof.chunked.loss_chunk_tokens
    device = get_profile("h100")
    lay = Layout(pp, 1, 1, 1, "1f1b", 1, m, mk["batch_size"] // m, 0)
    ev = Evaluator(prof, device, 1e15, mk["batch_size"])
    cand = price(ev, lay)
    plan = to_plan(ev, cand)
    out = []
    for p, c in ((prof, 0), (prof.chunked, chunk)):
        est = Evaluator(p, device, 1e15, mk["batch_size"]).evaluate(lay, cand.estimate.partition)
        out.append((dataclasses.replace(plan, loss_chunk_tokens=c),
                    [{k: v for k, v in row.items() if k != "runtime"} for row in est.memory]))
    return out, chunk


def main(argv=None) -> int:
    from autopar.runtime.spawn import run_ranks

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_args(ap, layers=8, d_model=256, heads=4, seq=1024, batch=8, vocab=65536)
    ap.add_argument("--pp", type=int, default=2, help="pipeline ranks (1f1b)")
    ap.add_argument("--microbatches", type=int, default=None, help="default: pp")
    ap.add_argument("--chunk", type=int, default=None, help="tokens per chunk (default: the planner's)")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per run (median)")
    ap.add_argument("--no-target", action="store_true", help="exit 0 when the run completes (smoke runs)")
    args = ap.parse_args(argv)
    mk = model_kwargs(args)
    m = args.microbatches or args.pp
    if args.batch % m:
        raise SystemExit(f"--batch {args.batch} is not divisible by {m} microbatches")
    runs_priced, chunk = _priced(mk, args.pp, m, args.chunk)
    d, v, s = args.d_model, args.vocab, args.seq
    head, block = 2 * d * v, 24 * d * d + 2 * s * d  # forward FLOPs per token (causal attention: half)
    plan = runs_priced[0][0]
    print(f"chunked_loss: gpt {args.layers} layers, d_model {d}, vocab {v} (the LM head is "
          f"{head / (head + args.layers * block) * 100:.0f}% of the forward FLOPs), fp32, AdamW; pp={args.pp} 1f1b, "
          f"{m} microbatches of {args.batch // m * s} tokens, stage cuts {list(plan.stage_cuts or ())}, one thread "
          f"per rank; chunk {chunk} tokens", flush=True)
    runs = {}
    for name, (plan, _rows) in zip(("as captured", "chunked"), runs_priced):
        runs[name] = run_ranks(_run, args.pp, dict(model_kwargs=mk, plan=plan, steps=args.steps),
                               deadline_s=3600, timeout_s=600)
    ok = True
    last = args.pp - 1
    print(f"\n  {'run':<12} {'rank':>4} {'peak MiB':>9} {'above states':>12} {'predicted':>9} {'error':>7} "
          f"{'peak RSS MiB':>12} {'step s':>7}")
    for (name, ranks), (_plan, rows) in zip(runs.items(), runs_priced):
        for r, (m_r, row) in enumerate(zip(ranks, rows)):
            pred = sum(row.values())
            err = (pred - m_r["peak"]) / m_r["peak"]
            good = abs(err) <= MAX_ERROR and err >= -MAX_UNDER
            ok &= good
            print(f"  {name:<12} {r:>4} {m_r['peak'] / MiB:>9.1f} {(m_r['peak'] - m_r['baseline']) / MiB:>12.1f} "
                  f"{pred / MiB:>9.1f} {err * 100:>+6.1f}% {m_r['rss'] / MiB:>12.1f} {m_r['step_s']:>7.3f}  "
                  f"{'ok' if good else 'MISS'}")
        print(f"      predicted, rank {last}: " + ", ".join(f"{k} {v / MiB:.1f}" for k, v in rows[last].items() if v))
    a, b = runs["as captured"][last], runs["chunked"][last]
    above = (b["peak"] - b["baseline"]) / (a["peak"] - a["baseline"])
    whole, rss = b["peak"] / a["peak"], b["rss"] / a["rss"]
    t = max(x["step_s"] for x in runs["chunked"]) / max(x["step_s"] for x in runs["as captured"])
    drift = max(abs(x - y) / abs(y) for x, y in zip(b["losses"], a["losses"]))
    print(f"\n  chunked / as captured, last stage (rank {last}): step peak above the states {above:.3f} (target <= "
          f"{MAX_MEMORY_RATIO}), whole peak {whole:.3f}, peak RSS {rss:.3f}; step time {t:.3f} (target <= "
          f"{MAX_TIME_RATIO}); losses agree to {drift:.1e}")
    ok &= above <= MAX_MEMORY_RATIO and t <= MAX_TIME_RATIO
    print("PASS" if ok else "FAIL")
    return 0 if ok or args.no_target else 1


if __name__ == "__main__":
    sys.exit(main())
