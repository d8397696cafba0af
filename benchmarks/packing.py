"""V3: real tokens per second, documents packed into rows vs one document per padded row, the
same documents and model, 2 gloo processes, in the same run.

    python benchmarks/packing.py            # --layers 2 --d-model 128 --heads 4 --seq 512 --batch 8 --steps 4

Documents: lengths from a log-normal with median ``seq * 600 / 4096`` and sigma 1 (issue 37's
distribution, median 600 in rows of 4096, scaled to the row length), each cut into row-long
pieces. Model: ``autopar.examples.gpt`` with ``position_ids`` (attention masked to each
document) and its own loss from ``labels``; plan dp=2, 2 microbatches, the global batch
``--batch`` rows of ``--seq`` tokens either way.

  packed   ``autopar.data.packed_batches``: each step's rows filled by best-fit decreasing
  padded   one document piece a row, the rest padding (what a loader without packing feeds a
           model of static shapes)

Measured per rank: the median step time over steps 2..``steps`` (step 1 warms up), and the real
tokens (valid labels) those steps hold. Real tokens/s = real tokens per step / step time.
Target (V3): packed / padded real tokens/s > 1.5. Prints PASS/FAIL; exit status 1 when the
target is missed.
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
os.environ.setdefault("OMP_NUM_THREADS", "1")

from autopar.runtime.spawn import run_ranks  # noqa: E402

TARGET = 1.5


def documents(seq: int, seed: int = 0):
    """The document stream: log-normal lengths, median seq * 600 / 4096, sigma 1 (tokens 1..255)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    while True:
        n = max(1, int(torch.empty(()).log_normal_(math.log(seq * 600 / 4096), 1.0, generator=g)))
        yield torch.randint(1, 256, (n,), generator=g)


def padded_batches(docs, seq: int, rows: int):
    """One document piece per row, ``rows`` rows a batch (the pack contract: positions, labels)."""
    import torch

    from autopar.data import pack

    held = []
    for d in docs:
        for piece in d.split(seq):
            held.append(pack([piece], seq))
            if len(held) == rows:
                yield {k: torch.cat([h[k] for h in held]) for k in held[0]}
                held = []


def _rank_main(rank, world, cfg):
    import torch

    import autopar
    from autopar.data import packed_batches
    from autopar.examples.gpt import GPT, GPTConfig

    seq, rows, steps = cfg["seq"], cfg["batch"], cfg["steps"]
    out = {}
    streams = {"packed": packed_batches(documents(seq), seq, rows, groups=2 * world),
               "padded": padded_batches(documents(seq), seq, rows)}
    for label, stream in streams.items():
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=256, seq_len=seq, n_layer=cfg["layers"], n_head=cfg["heads"],
                              d_model=cfg["d_model"]))
        batches = [next(stream) for _ in range(steps)]
        pm = autopar.parallelize(model, batches[0], loss_fn=None,
                                 optimizer=lambda g: torch.optim.AdamW(g, lr=1e-3),
                                 plan=autopar.Plan(dp=world, num_microbatches=2), timeout=120)
        times, real = [], []
        for batch in batches:
            t0 = time.perf_counter()
            pm.step(batch, None)
            times.append(time.perf_counter() - t0)
            real.append(int((batch["labels"] != -100).sum()))
        out[label] = {"step_s": statistics.median(times[1:]), "real": statistics.mean(real[1:]),
                      "slots": rows * seq}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=8, help="global batch (rows)")
    ap.add_argument("--steps", type=int, default=4)
    args = ap.parse_args(argv)
    if args.steps < 2 or args.batch % 4:
        raise SystemExit(f"--steps {args.steps} must be >= 2 and --batch {args.batch} a multiple of 4 "
                         "(2 replicas x 2 microbatches)")
    cfg = dict(seq=args.seq, batch=args.batch, steps=args.steps, layers=args.layers, heads=args.heads,
               d_model=args.d_model)
    print("running packed and padded batches under dp=2 on 2 processes ...", file=sys.stderr, flush=True)
    per_rank = run_ranks(_rank_main, 2, cfg, deadline_s=900)
    print(f"examples/gpt {args.layers} layers, d_model {args.d_model}, rows of {args.seq} tokens, {args.batch} rows "
          f"a step, dp=2 x 2 microbatches; medians of steps 2..{args.steps}")
    print(f"{'batches':<8} {'rank':>4} {'step ms':>9} {'real tokens':>12} {'of slots':>9} {'real tok/s':>11}")
    rates = {}
    for label in ("packed", "padded"):
        for r, res in enumerate(per_rank):
            x = res[label]
            rate = x["real"] / x["step_s"]
            rates[label, r] = rate
            print(f"{label:<8} {r:>4} {x['step_s'] * 1e3:>9.2f} {x['real']:>12.1f} {x['real'] / x['slots']:>9.3f} "
                  f"{rate:>11.1f}")
    ratio = min(rates["packed", r] / rates["padded", r] for r in range(len(per_rank)))
    print(f"\nV3: packed / padded real tokens per second {ratio:.2f}x (target > {TARGET}x): "
          f"{'PASS' if ratio > TARGET else 'FAIL'}")
    return 0 if ratio > TARGET else 1


if __name__ == "__main__":
    raise SystemExit(main())
