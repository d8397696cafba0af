"""P2: how long ``autopar plan`` takes on the requests of issue 34, phase by phase.

    python benchmarks/planner_speed.py                     # the four requests below, twice each
    python benchmarks/planner_speed.py --requests llama3-8b:64:512:8192

Each request is ``preset:gpus:global_batch:seq[:device]`` (device default h100). Every request
runs twice in this process: "first" (imports and the process's own caches cold for that
preset: what one ``autopar plan`` command pays, without Python start-up, about 2 s more) and
"again" (the same request once more: what a profile cache would leave, as far as this process's
in-memory caches go; no disk cache of the model profile exists yet). Printed per run: the
preset build, capture, unit traces, search (of which the stage-boundary ILPs) and the total
wall time, the chosen layout and its predicted step. The chosen plan of both runs must be the
same (the budgets count work: exit 1 otherwise). Target (issue 34): every request < 10 s warm,
< 15 s cold; printed as PASS/MISS per request, the exit status does not depend on it.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

REQUESTS = ("deepseek-v3:2048:15360:4096", "glm-5:2048:4096:4096", "llama3-405b:16384:2048:8192:h100",
            "glm-5:4096:8192:4096")
COLD_S, WARM_S = 15.0, 10.0


def _parse(spec: str) -> dict:
    parts = spec.split(":")
    if len(parts) not in (4, 5):
        raise SystemExit(f"planner_speed: request {spec!r}: expected preset:gpus:global_batch:seq[:device]")
    return dict(preset=parts[0], gpus=int(parts[1]), batch=int(parts[2]), seq=int(parts[3]),
                device=parts[4] if len(parts) == 5 else "h100")


def run_once(req: dict) -> dict:
    """One request as ``autopar plan`` runs it (preset build, profile, search); its phase times."""
    import torch

    from autopar.planner import plan_model, presets
    from autopar.planner.devices import get_profile

    torch.set_num_threads(1)
    t0 = time.perf_counter()
    pm = presets.build_preset(req["preset"], seq_len=req["seq"])
    built = time.perf_counter()
    res, info = plan_model(pm.model, pm.inputs, pm.target, pm.loss_fn, gpus=req["gpus"],
                           global_batch=req["batch"], device=get_profile(req["device"]), name=pm.name,
                           layer_repeats=pm.layer_repeats, expert_prefixes=pm.expert_param_prefixes,
                           n_heads=pm.n_heads, n_experts=pm.n_experts, seq_len=req["seq"], moe=pm.moe)
    total = time.perf_counter() - t0
    chosen = res.chosen
    lay = chosen.layout if chosen is not None else None
    return {"build_s": built - t0, "capture_s": info["capture_s"], "trace_s": info["trace_s"],
            "search_s": res.search_s, "ilp_s": res.solver_s, "total_s": total,
            "layout": None if lay is None else (lay.pp, lay.dp, lay.cp, lay.ep, lay.schedule, lay.m, lay.zero),
            "step_s": None if chosen is None else chosen.time}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", default=",".join(REQUESTS),
                    help="comma-separated preset:gpus:global_batch:seq[:device]")
    args = ap.parse_args(argv)
    reqs = [_parse(x.strip()) for x in args.requests.split(",") if x.strip()]
    same = True
    print(f"{'request':<38} {'run':<6} {'build':>6} {'capture':>8} {'traces':>7} {'search':>7} {'(ILP)':>6} "
          f"{'total s':>8}  chosen")
    for req in reqs:
        label = f"{req['preset']} {req['gpus']} GPUs {req['batch']}x{req['seq']} {req['device']}"
        runs = {}
        for run in ("first", "again"):
            r = runs[run] = run_once(req)
            chosen = "none fits" if r["layout"] is None else (
                "pp{} dp{} cp{} ep{} {} m{} ZeRO{}".format(*r["layout"]) + f", {r['step_s']:.4g} s a step")
            print(f"{label:<38} {run:<6} {r['build_s']:>6.2f} {r['capture_s']:>8.2f} {r['trace_s']:>7.2f} "
                  f"{r['search_s']:>7.2f} {r['ilp_s']:>6.2f} {r['total_s']:>8.2f}  {chosen}", flush=True)
        first, again = runs["first"], runs["again"]
        agree = first["layout"] == again["layout"] and first["step_s"] == again["step_s"]
        same &= agree
        verdict = "PASS" if runs["first"]["total_s"] < COLD_S and runs["again"]["total_s"] < WARM_S else "MISS"
        print(f"  {label}: the same plan both times: {'yes' if agree else 'NO'}; target first < {COLD_S:g} s, again "
              f"< {WARM_S:g} s: {verdict}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
