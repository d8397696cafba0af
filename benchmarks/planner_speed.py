"""P2: how long ``autopar plan`` takes on large requests, cold and with a warm profile cache.

    python benchmarks/planner_speed.py                     # the six requests below
    python benchmarks/planner_speed.py --requests llama3-8b:64:512:8192
    python benchmarks/planner_speed.py --requests benchmarks/configs/qwen3-30b-a3b.json:64:512:4096

Each request is ``model:gpus:global_batch:seq[:device]`` (device default h100), the model a
preset name or a Hugging Face ``config.json`` (``--hf-config``; benchmarks/configs holds
Qwen3-30B-A3B's published one), and runs as the real command, ``python -m autopar.cli plan
... --json`` in a new process (Python start-up and imports included), twice: "cold" with an
empty profile cache (``$AUTOPAR_CACHE_DIR`` a fresh temporary folder: the model is captured
and traced, and its profile written there) and "warm" (the same folder: the profile is read
back, planner/profile_cache.py). Printed per run: the wall time of the process and the phases
it reports (capture, unit traces, search, of which the stage-boundary ILPs), the chosen layout
and its predicted step. Both runs must choose the same plan (the budgets count work).
Target: every request < 10 s warm, < 15 s cold (``--cold-s``, ``--warm-s``), printed as
PASS/MISS per request. Exit status 1 when a target is missed or the two runs disagree.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

REQUESTS = ("deepseek-v3:2048:15360:4096", "glm-5:2048:4096:4096", "llama3-405b:16384:2048:8192:h100",
            "glm-5:4096:8192:4096", "llama3-8b:64:64:131072",
            os.path.join("benchmarks", "configs", "qwen3-30b-a3b.json") + ":64:512:4096")
COLD_S, WARM_S = 15.0, 10.0


def _parse(spec: str) -> dict:
    parts = spec.split(":")
    if len(parts) not in (4, 5):
        raise SystemExit(f"planner_speed: request {spec!r}: expected model:gpus:global_batch:seq[:device]")
    return dict(preset=parts[0], gpus=int(parts[1]), batch=int(parts[2]), seq=int(parts[3]),
                device=parts[4] if len(parts) == 5 else "h100")


def run_once(req: dict, cache: str) -> dict:
    """One request as the ``autopar plan`` command, with the profile cache in ``cache``."""
    model = ["--hf-config", os.path.join(ROOT, req["preset"]) if not os.path.isabs(req["preset"]) else req["preset"]] \
        if req["preset"].endswith(".json") else [req["preset"]]
    cmd = [sys.executable, "-m", "autopar.cli", "plan", *model, "--gpus", str(req["gpus"]),
           "--global-batch", str(req["batch"]), "--seq", str(req["seq"]), "--device", req["device"], "--json"]
    t0 = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "AUTOPAR_CACHE_DIR": cache})
    wall = time.perf_counter() - t0
    if out.returncode != 0:
        raise SystemExit(f"planner_speed: {' '.join(cmd)} failed:\n{out.stderr[-2000:]}")
    d = json.loads(out.stdout)
    lay = None if not d.get("feasible") else (d.get("tp", 1), d["pp"], d["dp"], d["cp"], d["ep"], d["schedule"],
                                              d["num_microbatches"], d["zero"])
    return {"capture_s": 0.0 if d.get("profile_cached") else d["capture_s"],
            "trace_s": 0.0 if d.get("profile_cached") else d["trace_s"], "cached": bool(d.get("profile_cached")),
            "search_s": d["search_s"], "ilp_s": d["solver"]["solver_s"], "total_s": wall, "layout": lay,
            "step_s": d.get("predicted_step_time_s")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", default=",".join(REQUESTS),
                    help="comma-separated preset:gpus:global_batch:seq[:device]")
    ap.add_argument("--cold-s", type=float, default=COLD_S, help="target seconds with an empty profile cache")
    ap.add_argument("--warm-s", type=float, default=WARM_S, help="target seconds with the profile cached")
    args = ap.parse_args(argv)
    reqs = [_parse(x.strip()) for x in args.requests.split(",") if x.strip()]
    same = met = True
    print(f"{'request':<38} {'run':<5} {'capture':>8} {'traces':>7} {'search':>7} {'(ILP)':>6} {'wall s':>7}  chosen")
    for req in reqs:
        label = f"{os.path.basename(req['preset'])} {req['gpus']} GPUs {req['batch']}x{req['seq']} {req['device']}"
        runs = {}
        with tempfile.TemporaryDirectory(prefix="autopar-cache-") as cache:
            for run in ("cold", "warm"):
                r = runs[run] = run_once(req, cache)
                chosen = "none fits" if r["layout"] is None else (
                    "tp{} pp{} dp{} cp{} ep{} {} m{} ZeRO{}".format(*r["layout"]) + f", {r['step_s']:.4g} s a step")
                cap = "cached" if r["cached"] else f"{r['capture_s']:.2f}"
                print(f"{label:<38} {run:<5} {cap:>8} {r['trace_s']:>7.2f} {r['search_s']:>7.2f} {r['ilp_s']:>6.2f} "
                      f"{r['total_s']:>7.2f}  {chosen}", flush=True)
        cold, warm = runs["cold"], runs["warm"]
        agree = cold["layout"] == warm["layout"] and cold["step_s"] == warm["step_s"] and warm["cached"]
        same &= agree
        ok = cold["total_s"] < args.cold_s and warm["total_s"] < args.warm_s
        met &= ok
        print(f"  {label}: the same plan both times, the second from the cache: {'yes' if agree else 'NO'}; "
              f"target cold < {args.cold_s:g} s, warm < {args.warm_s:g} s: {'PASS' if ok else 'MISS'}")
    if not (same and met):
        print(f"planner_speed: FAIL ({'a target missed' if not met else ''}"
              f"{'; ' if not met and not same else ''}{'the cached run chose another plan' if not same else ''})")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
