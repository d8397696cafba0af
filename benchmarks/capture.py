"""A6: time to capture a large GPT and split it into pipeline stages and F/I/W programs.

The example GPT is built on the meta device (no storage, no values) and put through the
whole graph front end, each phase timed separately:

  capture         torch.export (non-strict) + run_decompositions + FLOP/byte annotation
  split_stages    choosing the cuts and building one forward graph per stage
  split_backward  per stage: make_fx of the joint forward+backward, F/I/W/B partitioning

    python benchmarks/capture.py [--layers 48 --d-model 1024 --heads 16 --seq 1024 --batch 1 --stages 8]
    python benchmarks/capture.py --profile      # + cProfile top entries per phase

Target: capture + split_stages + split_backward under 60 s on the 2-core CI machine.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time

import torch

TARGET_TOTAL_S = 60.0


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--d-model", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=1, help="microbatch size")
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--stages", type=int, default=8)
    ap.add_argument("--device", default="meta", help="meta (default) or cpu (allocates the model)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--profile", action="store_true", help="cProfile each phase and print the top entries")
    ap.add_argument("--top", type=int, default=15, help="rows per cProfile table")
    return ap.parse_args(argv)


class Phase:
    """Times (and optionally cProfiles) one phase; keeps wall and process-CPU seconds."""

    def __init__(self, name: str, profile: bool):
        self.name, self.profile = name, profile
        self.wall = self.cpu = 0.0
        self.stats: pstats.Stats | None = None

    def __enter__(self):
        self._prof = cProfile.Profile() if self.profile else None
        self._c0, self._t0 = time.process_time(), time.perf_counter()
        if self._prof:
            self._prof.enable()
        return self

    def __exit__(self, *exc):
        if self._prof:
            self._prof.disable()
        self.wall = time.perf_counter() - self._t0
        self.cpu = time.process_time() - self._c0
        if self._prof:
            self.stats = pstats.Stats(self._prof)
        return False


def top_table(stats: pstats.Stats, sort: str, n: int) -> str:
    buf = io.StringIO()
    stats.stream = buf
    stats.sort_stats(sort).print_stats(n)
    lines = [ln for ln in buf.getvalue().splitlines() if ln.strip()]
    # drop pstats' preamble (timer line, "Ordered by", "List reduced")
    start = next((i for i, ln in enumerate(lines) if ln.lstrip().startswith("ncalls")), 0)
    return "\n".join(lines[start:])


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    from autopar.examples.gpt import make_gpt
    from autopar.passes import capture, split_backward, split_stages

    print(f"capture benchmark: GPT {args.layers} layers, d_model={args.d_model}, heads={args.heads}, "
          f"seq={args.seq}, microbatch={args.batch}, vocab={args.vocab}, {args.stages} stages, "
          f"device={args.device}, torch {torch.__version__}, {torch.get_num_threads()} thread(s)")
    t0 = time.perf_counter()
    model, inputs, target, loss_fn = make_gpt(n_layer=args.layers, d_model=args.d_model, n_head=args.heads,
                                              vocab_size=args.vocab, seq_len=args.seq, batch_size=args.batch,
                                              device=args.device)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"built model ({n_params / 1e6:.1f} M parameters) in {time.perf_counter() - t0:.2f} s (not counted)")

    phases = []
    try:
        with Phase("capture", args.profile) as ph:
            phases.append(ph)
            cap = capture(model, inputs, target, loss_fn)
        print(f"  {'capture':>15}: {ph.wall:7.2f} s   ({cap.summary()})")
        with Phase("split_stages", args.profile) as ph:
            phases.append(ph)
            stages = split_stages(cap, args.stages)
        print(f"  {'split_stages':>15}: {ph.wall:7.2f} s   (ops per stage: "
              + ", ".join(str(sum(1 for n in s.gm.graph.nodes if n.op == "call_function")) for s in stages) + ")")
        per_stage = []
        with Phase("split_backward", args.profile) as ph:
            phases.append(ph)
            req: dict[str, bool] = {}
            for st in stages:
                s0 = time.perf_counter()
                prog = split_backward(st, req)
                per_stage.append(time.perf_counter() - s0)
                req = {n: True for n in prog.diff_outputs}
        print(f"  {'split_backward':>15}: {ph.wall:7.2f} s   (per stage: "
              + ", ".join(f"{t:.2f}" for t in per_stage) + ")")
    except Exception as e:  # noqa: BLE001 - report which phase failed and keep the traceback
        name = phases[-1].name if phases else "build"
        print(f"FAIL: {name} raised {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        raise

    total = sum(p.wall for p in phases)
    total_cpu = sum(p.cpu for p in phases)
    print()
    for p in phases:
        print(f"{p.name} = {p.wall:.2f} s  ({100 * p.wall / total:.0f}% of total, cpu {p.cpu:.2f} s)")
    print(f"total(capture+split_stages+split_backward) = {total:.2f} s  (target < {TARGET_TOTAL_S:.0f} s)  "
          f"{'MET' if total < TARGET_TOTAL_S else 'NOT MET'}   [process cpu {total_cpu:.2f} s]")

    if args.profile:
        for p in phases:
            print(f"\n--- cProfile {p.name}: top {args.top} by own time ---")
            print(top_table(p.stats, "tottime", args.top))
            print(f"\n--- cProfile {p.name}: top {args.top} by cumulative time ---")
            print(top_table(p.stats, "cumulative", args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
