"""M2 (issue 35): the chunked cross-entropy against the loss as captured, on the same machine.

    python benchmarks/chunked_loss.py     # --layers 57 --d-model 256 --heads 4 --seq 1024 --batch 4 --vocab 65536
    python benchmarks/chunked_loss.py --layers 2                           # the head almost alone

Model: ``autopar.examples.gpt`` (tied embedding / LM head, ``F.cross_entropy`` on the logits),
fp32, AdamW. Its depth sets the LM head's share of the forward FLOPs, and with it the time
ratio: the chunked loss runs one head GEMM more per microbatch (it recomputes the logits for the
weight gradient). The default, 57 blocks of width 256 under a 64k vocabulary, gives the head
22% of the FLOPs, as in the small open models (Llama-3.2-1B 19%, Qwen2.5-0.5B 23% at 4k
tokens); at 8B it is ~7%. One microbatch of ``--batch`` x ``--seq`` tokens (4096 by default) on one gloo
process (pp=1): the last stage is the whole model, so its peak is the loss's. Two runs, each in
a fresh process: ``Plan(loss_chunk_tokens=0)`` (the loss as captured: the ``[tokens, vocab]``
logits, their log-softmax and their gradient) and ``Plan(loss_chunk_tokens=C)`` with the
planner's chunk for this vocabulary (``linear_ce.default_chunk``; ``--chunk`` overrides).

Measured per run: step 1 unobserved (AdamW creates its states); step 2 inside
``PeakTensorMemory`` (live tensor bytes: parameters, gradients and AdamW states at entry, plus
every storage an op creates, the chunked ops' own buffers included: ``probe_inside_kernels``);
then ``--steps`` timed steps (median); the process's peak RSS (``ru_maxrss``: the whole run,
capture included). Predicted: the planner's ``Estimate.peak_memory`` of this layout from
``profile_model`` on the same model (the chunked run from ``ModelProfile.chunked``), without the
device's fixed runtime overhead, which the probe does not see.

Targets (M2): chunked / as captured <= 0.35 on the step's peak live bytes above the
parameters, gradients and optimizer states (the loss's memory; the whole peak is printed too),
step time ratio <= 1.10, and each prediction within the memory model's bounds (|error| <= 15%,
never under by more than 5%: benchmarks/memory_model.py). Exit 1 when a target is missed.
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

    torch.set_num_threads(cfg["threads"])
    model, inputs, target, loss_fn = make_gpt(**cfg["model_kwargs"])
    pm = autopar.parallelize(model, inputs, loss_fn=loss_fn, optimizer=functools.partial(torch.optim.AdamW, lr=1e-4),
                             plan=autopar.Plan(pp=1, num_microbatches=1, loss_chunk_tokens=cfg["chunk"]),
                             example_target=target)
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


def _predicted(mk: dict) -> tuple[dict, dict, int]:
    """(rows as captured, rows chunked, the chunk): the planner's memory rows of pp=1, one
    microbatch of the whole batch, without the runtime overhead."""
    from autopar.examples.gpt import make_gpt
    from autopar.planner.devices import get_profile
    from autopar.planner.estimate import Evaluator, Layout, Partition
    from autopar.planner.profile import profile_model

    model, inputs, target, loss_fn = make_gpt(**mk)
    prof = profile_model(model, inputs, target, loss_fn, name="gpt")
    if prof.chunked is None:
        raise SystemExit("chunked_loss: the planner found no chunkable loss in examples/gpt")
    rows = []
    for p in (prof, prof.chunked):
        ev = Evaluator(p, get_profile("h100"), 1e15, mk["batch_size"])
        lay = Layout(1, 1, 1, 1, "1f1b", 1, 1, mk["batch_size"], 0)
        est = ev.evaluate(lay, Partition((0, len(p.units)), (False,)))
        rows.append({k: v for k, v in est.memory[0].items() if k != "runtime"})
    return rows[0], rows[1], prof.chunked.loss_chunk_tokens


def main(argv=None) -> int:
    from autopar.runtime.spawn import run_ranks

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_args(ap, layers=57, d_model=256, heads=4, seq=1024, batch=4, vocab=65536)
    ap.add_argument("--chunk", type=int, default=None, help="tokens per chunk (default: the planner's)")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per run (median)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads in each run")
    args = ap.parse_args(argv)
    mk = model_kwargs(args)
    tokens = args.batch * args.seq
    plain_rows, chunked_rows, chunk = _predicted(mk)
    chunk = args.chunk or chunk
    d, v, s = args.d_model, args.vocab, args.seq
    head, block = 2 * d * v, 24 * d * d + 2 * s * d  # forward FLOPs per token (causal attention: half)
    print(f"chunked_loss: gpt {args.layers} layers, d_model {d}, vocab {v}, one microbatch of {tokens} tokens, fp32, "
          f"AdamW, pp=1 on one gloo process, {args.threads} threads; chunk {chunk} tokens; the LM head is "
          f"{head / (head + args.layers * block) * 100:.0f}% of the forward FLOPs", flush=True)
    runs = {}
    for name, c in (("as captured", 0), ("chunked", chunk)):
        cfg = dict(model_kwargs=mk, chunk=c, steps=args.steps, threads=args.threads)
        runs[name] = run_ranks(_run, 1, cfg, deadline_s=3600, timeout_s=600)[0]
    ok = True
    print(f"\n  {'run':<12} {'peak MiB':>9} {'above states':>12} {'predicted':>9} {'error':>7} {'peak RSS MiB':>12} "
          f"{'step s':>7}")
    for (name, m), rows in zip(runs.items(), (plain_rows, chunked_rows)):
        pred = sum(rows.values())
        err = (pred - m["peak"]) / m["peak"]
        good = abs(err) <= MAX_ERROR and err >= -MAX_UNDER
        ok &= good
        print(f"  {name:<12} {m['peak'] / MiB:>9.1f} {(m['peak'] - m['baseline']) / MiB:>12.1f} {pred / MiB:>9.1f} "
              f"{err * 100:>+6.1f}% {m['rss'] / MiB:>12.1f} {m['step_s']:>7.3f}  {'ok' if good else 'MISS'}")
        print("      predicted: " + ", ".join(f"{k} {v / MiB:.1f}" for k, v in rows.items() if v))
    a, b = runs["as captured"], runs["chunked"]
    above = (b["peak"] - b["baseline"]) / (a["peak"] - a["baseline"])
    whole, rss = b["peak"] / a["peak"], b["rss"] / a["rss"]
    t = b["step_s"] / a["step_s"]
    drift = max(abs(x - y) / abs(y) for x, y in zip(b["losses"], a["losses"]))
    print(f"\n  chunked / as captured: step peak above the states {above:.3f} (target <= {MAX_MEMORY_RATIO}), whole "
          f"peak {whole:.3f}, peak RSS {rss:.3f}; step time {t:.3f} (target <= {MAX_TIME_RATIO}); losses agree to "
          f"{drift:.1e}")
    ok &= above <= MAX_MEMORY_RATIO and t <= MAX_TIME_RATIO
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
