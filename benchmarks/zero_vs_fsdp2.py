"""X3: one dp=2 training step of examples/gpt, autopar ZeRO-3 vs torch's FSDP2 (``fully_shard``).

    python benchmarks/zero_vs_fsdp2.py          # --layers 4 --d-model 256 --heads 4 --seq 128 --batch 8
    python benchmarks/zero_vs_fsdp2.py --rounds 8 --steps 3

Both run in the same 2 spawned gloo processes (one thread each), on the same seeded model and
global batch, AdamW, fp32:
  autopar   ``parallelize(..., Plan(dp=2, zero=3, num_microbatches=1))``: flat sharded layer
            groups, two alternating gather buffers with prefetch, reduce-scatter per group as
            soon as its W ran (runtime/sharded.py)
  fsdp2     ``fully_shard`` on every block, then on the root (the tied embedding/LM head
            sits in the root group), default reshard_after_forward=True, eager forward and
            backward; each rank gets its half of the batch
Timing: after 2 warm-up steps each, ``--rounds`` rounds alternate ``--steps`` steps of
autopar and of fsdp2 (so both see the same machine load); the median step time of each is
compared. Memory: peak live tensor bytes during one more step of each
(``runtime/memory_probe.PeakTensorMemory``; FSDP2's DTensor shards are counted by the local
tensors they wrap), and the steady parameter + gradient + optimizer-state bytes.
The first step's losses of both are printed as a sanity check (they must agree to ~1e-6).

Target (X3): autopar / fsdp2 step time <= 1.0. Exit code 0 when the run completed.
"""
from __future__ import annotations

import argparse
import copy
import functools
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

KiB = 1024


def _rank_main(rank, world, cfg):
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import autopar
    from autopar.examples.gpt import make_gpt
    from autopar.runtime.memory_probe import PeakTensorMemory, storage_bytes

    model, inputs, target, loss_fn = make_gpt(**cfg["model"])
    peer = copy.deepcopy(model)
    opt = functools.partial(torch.optim.AdamW, lr=1e-3)

    pm = autopar.parallelize(model, inputs, loss_fn=loss_fn, optimizer=opt, example_target=target,
                             plan=autopar.Plan(dp=world, schedule="1f1b", num_microbatches=1, zero=3))

    mesh = init_device_mesh("cpu", (world,))
    for block in peer.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(peer, mesh=mesh)
    peer_opt = opt(peer.parameters())
    n = inputs[0].shape[0] // world
    x, y = inputs[0][rank * n: (rank + 1) * n], target[rank * n: (rank + 1) * n]

    def fsdp_step():
        loss = loss_fn(peer(x), y)
        loss.backward()
        peer_opt.step()
        peer_opt.zero_grad(set_to_none=True)
        return loss.detach()

    def ours_step():
        return pm.step(inputs, target)

    first = {"autopar": float(ours_step()), "fsdp2": None}
    loss = fsdp_step()
    dist.all_reduce(loss)
    first["fsdp2"] = float(loss) / world
    ours_step(), fsdp_step()
    times = {"autopar": [], "fsdp2": []}
    for _ in range(cfg["rounds"]):
        for name, fn in (("autopar", ours_step), ("fsdp2", fsdp_step)):
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(cfg["steps"]):
                fn()
            dist.barrier()
            times[name].append((time.perf_counter() - t0) / cfg["steps"])

    sharded = pm.built.parallelisms["dp"].storage
    ours_state = [p.data for p in pm.built.params.values() if p.data.numel()] + sharded.masters() + \
        [t for st in pm.optimizer.state.values() for t in st.values() if isinstance(t, torch.Tensor)]
    peer_state = list(peer.parameters()) + \
        [t for st in peer_opt.state.values() for t in st.values() if isinstance(t, torch.Tensor)]
    peaks = {}
    with PeakTensorMemory(ours_state) as probe:
        ours_step()
    peaks["autopar"] = (probe.baseline_bytes, probe.peak_bytes)
    with PeakTensorMemory(peer_state) as probe:
        fsdp_step()
    peaks["fsdp2"] = (probe.baseline_bytes, probe.peak_bytes)
    return {"times": times, "first": first, "peaks": peaks, "gathers": sharded.gathers,
            "state": {"autopar": storage_bytes(ours_state), "fsdp2": storage_bytes(peer_state)}}


def _parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(ap, layers=4, d_model=256, seq=128, batch=8, vocab=512)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3)
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = _parse(argv)
    model = model_kwargs(args)
    print("running autopar ZeRO-3 and FSDP2 on 2 gloo processes ...", file=sys.stderr, flush=True)
    res = run_ranks(_rank_main, 2, dict(model=model, rounds=args.rounds, steps=args.steps), deadline_s=900)
    r0 = res[0]
    med = {k: statistics.median(max(res[r]["times"][k][i] for r in range(2)) for i in range(args.rounds))
           for k in ("autopar", "fsdp2")}
    print(f"examples/gpt {args.layers} layers, d_model {args.d_model}, seq {args.seq}, vocab {args.vocab}, "
          f"global batch {args.batch}; dp=2, 2 gloo processes, AdamW fp32")
    print(f"first-step loss: autopar {r0['first']['autopar']:.7f}  fsdp2 {r0['first']['fsdp2']:.7f}")
    print(f"{'':<9} {'step ms (median of rounds)':>27} {'state KiB':>10} {'peak KiB':>9}")
    for k in ("autopar", "fsdp2"):
        print(f"{k:<9} {med[k] * 1e3:>27.1f} {r0['state'][k] / KiB:>10.1f} {r0['peaks'][k][1] / KiB:>9.1f}")
    ratio = med["autopar"] / med["fsdp2"]
    print(f"\nX3: autopar / fsdp2 step time = {ratio:.3f} (target <= 1.0): {'PASS' if ratio <= 1.0 else 'FAIL'}; "
          f"peak memory autopar / fsdp2 = {r0['peaks']['autopar'][1] / r0['peaks']['fsdp2'][1]:.3f}; "
          f"autopar issued {r0['gathers']} parameter all-gathers per rank in all")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
