"""autopar schedules vs torch.distributed.pipelining's, replayed by the same simulator.

    python benchmarks/schedules_vs_torch.py [--pp 4 8] [--quick]

torch's orders come from ``_schedule_visualizer.get_schedule_ops`` (no process group needed)
and are converted into autopar actions (OVERLAP_F_B becomes an F&B unit); both sides are then
validated and simulated with identical per-rank F/I/W costs, zero P2P latency, and the same
memory model (I frees half of a stage's activations, W the rest).

Table 1: makespan ours / torch for the same schedule (target <= 1.00 everywhere).
Table 2: the best schedule of each library whose peak activation memory fits p * M_B (1F1B's
budget), per cell; "bound" is the single-step lower bound for two stages per rank,
m(F+I+W) + (p-1)F/2 (the last rank cannot start before microbatch 0 reaches it).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from autopar.schedules import Action, build, peak_memory, simulate, validate  # noqa: E402
from autopar.schedules.ir import linear_layout, make_schedule, v_layout  # noqa: E402

PROFILES = {"1,1,1": (1.0, 1.0, 1.0), "1,1.5,0.5": (1.0, 1.5, 0.5), "1,0.7,1.3": (1.0, 0.7, 1.3)}
PAIRS = [  # (torch class name, autopar name, stages per rank)
    ("GPipe", "gpipe", 1),
    ("Interleaved1F1B", "interleaved-1f1b", 2),
    ("InterleavedZeroBubble", "zb-h1", 2),
    ("ZBVZeroBubble", "zbv", 2),
    ("DualPipeV", "dualpipev", 2),
]
EPS = 1e-9


def torch_schedule(cls: str, pp: int, m: int, v: int):
    """torch's compute order for ``cls`` as an autopar Schedule (validated)."""
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops
    from torch.distributed.pipelining.schedules import _ComputationType as CT

    kinds = {CT.FORWARD: "F", CT.BACKWARD_INPUT: "I", CT.BACKWARD_WEIGHT: "W", CT.FULL_BACKWARD: "B"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ops = get_schedule_ops(cls, pp, m, num_stages_per_rank=v if v > 1 else None)
    acts, overlaps = [], []
    for row in ops:
        out, ovl = [], []
        for a in row:
            if a is None:
                continue
            if a.computation_type == CT.OVERLAP_F_B:
                ovl.append(len(out))
                out += [Action(x.stage_index, kinds[x.computation_type], x.microbatch_index) for x in a.sub_actions]
            elif a.computation_type in kinds:
                out.append(Action(a.stage_index, kinds[a.computation_type], a.microbatch_index))
            # REDUCE_GRAD and other bookkeeping actions take no time in this model
        acts.append(out)
        overlaps.append(ovl)
    layout = v_layout(pp) if cls in ("ZBVZeroBubble", "DualPipeV") else linear_layout(pp, v)
    return validate(make_schedule(f"torch:{cls}", pp, layout, m, acts, overlaps))


def table1(pps, quick):
    print("Table 1: makespan ours / torch, same schedule, same simulator (<= 1.00 is the target)")
    head = f"{'schedule':<37}{'pp':>3}{'m':>4}  " + "".join(f"{k:>11}" for k in PROFILES) + "   same order?"
    print(head)
    print("-" * len(head))
    worst = 0.0
    for cls, ours, v in PAIRS:
        for pp in pps:
            for m in ((2 * pp,) if quick else (2 * pp, 4 * pp)):
                a = build(ours, pp, m, stages_per_rank=v)
                t = torch_schedule(cls, pp, m, v)
                cells = []
                for costs in PROFILES.values():
                    ratio = simulate(a, costs).makespan / simulate(t, costs).makespan
                    worst = max(worst, ratio)
                    cells.append(f"{ratio:11.3f}")
                same = "yes" if (a.actions, a.overlap) == (t.actions, t.overlap) else "no"
                print(f"{ours + ' vs ' + cls:<37}{pp:>3}{m:>4}  " + "".join(cells) + f"   {same}")
    print(f"worst ratio: {worst:.3f}\n")
    return worst


def best_under(candidates, costs, limit):
    fits = [(simulate(s, costs).makespan, label) for label, s in candidates
            if max(peak_memory(s)) <= limit + EPS]
    return min(fits)


def table2(pps, quick, effort):
    print("Table 2: best schedule under p * M_B per rank (ours includes zb-auto searched on the real costs)")
    head = (f"{'pp':>3}{'m':>4} {'F,I,W':<10}{'bound':>8}{'best torch':>11} {'':<22}{'best ours':>10} {'':<24}"
            f"{'ratio':>6}{'effort=' + str(effort):>12}{'ratio':>7}")
    print(head)
    print("-" * len(head))
    results = []
    for pp in pps:
        for m in ((2 * pp,) if quick else (2 * pp, 4 * pp)):
            torch_cands = [(cls, torch_schedule(cls, pp, m, v)) for cls, _, v in PAIRS]
            fixed = []
            for name in ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zbv", "v-half", "v-min", "dualpipev"):
                for v in ((1, 2) if name == "zb-h1" else (None,)):
                    fixed.append((name if v in (None, 1) else f"{name}(v=2)", build(name, pp, m, stages_per_rank=v)))
            for key, costs in PROFILES.items():
                ours = list(fixed)
                for v in (1, 2):
                    ours.append((f"zb-auto(v={v})", build("zb-auto", pp, m, v, costs=costs, memory_limit=pp)))
                bt, lt = best_under(torch_cands, costs, pp)
                bo, lo = best_under(ours, costs, pp)
                be = bo
                if effort:
                    hard = build("zb-auto", pp, m, 2, costs=costs, memory_limit=pp, effort=effort)
                    be = min(bo, simulate(hard, costs).makespan)
                bound = m * sum(costs) + (pp - 1) * costs[0] / 2
                results.append((key, bo / bt, be / bt))
                print(f"{pp:>3}{m:>4} {key:<10}{bound:8.2f}{bt:11.2f} {lt:<22}{bo:10.2f} {lo:<24}{bo / bt:6.3f}"
                      f"{be:12.2f}{be / bt:7.3f}")
    print()
    for key in PROFILES:
        rs = [r for k, r, _ in results if k == key]
        es = [e for k, _, e in results if k == key]
        print(f"profile {key:<10} ours/torch: default min {min(rs):.3f} max {max(rs):.3f}; "
              f"effort={effort} min {min(es):.3f} max {max(es):.3f}")
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pp", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--quick", action="store_true", help="m = 2p only")
    ap.add_argument("--effort", type=int, default=64, help="zb-auto randomized restarts for the last columns")
    args = ap.parse_args(argv)
    t0 = time.time()
    import torch  # noqa: F401  (only the benchmark needs torch)

    print(f"torch {torch.__version__}; costs are per-rank F,I,W; P2P latency 0; memory unit M_B\n")
    table1(args.pp, args.quick)
    table2(args.pp, args.quick, args.effort)
    print(f"\n(ran in {time.time() - t0:.1f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
