"""Readable views of the generated programs: the stage table and `dump` (code of every F/I/W/B)."""
from __future__ import annotations

import os


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n}"


def stage_rows(programs, schedule) -> list[dict]:
    """One row per stage whose programs this process holds (in distributed mode: its own)."""
    rows = []
    for prog in programs:
        if not hasattr(prog, "f"):
            continue
        st = prog.stage
        rank = schedule.stage_to_rank[st.index] if schedule is not None else 0
        rows.append({
            "stage": st.index, "rank": rank,
            "params": len(st.params),
            "param_bytes": sum(n.meta.get("autopar_bytes", 0) for n in st.gm.graph.nodes
                               if n.op == "placeholder" and n.name in _param_placeholders(st)),
            "fwd_gflop": prog.f.flops / 1e9, "i_gflop": prog.i.flops / 1e9, "w_gflop": prog.w.flops / 1e9,
            "saved_bytes": prog.saved_bytes, "bytes_in": st.bytes_in, "bytes_out": st.bytes_out,
            "backward": _backward_mode(prog),
        })
    return rows


def _backward_mode(prog) -> str:
    """What F keeps for the backward: "recompute" (its inputs; I replays the forward), "remake"
    (element-wise values made again in I and W: ``Plan.remake``) or "keep" (every value it reads)."""
    return "recompute" if prog.recompute else "remake" if prog.remake else "keep"


def _param_placeholders(st) -> set[str]:
    phs = [n.name for n in st.gm.graph.nodes if n.op == "placeholder"]
    return set(phs[: len(st.params)])


def resident_parameter_bytes(pm) -> int:
    """Bytes of real parameter storage on this process: the distinct storages of its model's
    parameters (a tensor of another rank's stage stays on meta: none) and its ZeRO-2/3 storage
    (fp32 master shards, gather buffers, resident group) and mixed-precision masters."""
    seen, total = set(), 0

    def count(t):
        nonlocal total
        if t is None or t.is_meta or not t.numel():
            return
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()

    for p in pm.model.parameters():
        count(p)
    dp = pm.built.parallelisms["dp"]
    for m in dp.masters.values():
        count(m)
    if dp.storage is not None:
        for g in dp.storage.groups:
            count(g.master)
        for b in dp.storage.buffers:
            count(b)
        for buf in dp.storage.residents.values():
            count(buf)
    if dp.optimizer is not None:  # what the optimizer steps: ZeRO-1 shards, masters (counted once)
        for group in dp.optimizer.param_groups:
            for p in group["params"]:
                count(p)
    return total


def stage_table(programs, schedule=None, rows: list[dict] | None = None, routes: dict | None = None,
                offloaded: dict | None = None) -> str:
    """``routes``: the optimizer's routing (``autopar.Muon``): a column counts each stage's
    parameters it steps with Muon. ``offloaded``: per stage this process runs, the bytes the
    activation offload (``Plan.offload``) copied to the host in the last step: an
    "offload/step" column. The "backward" column says what each stage's F keeps for the
    backward: "keep", "remake" (``Plan.remake``) or "recompute"."""
    rows = stage_rows(programs, schedule) if rows is None else sorted(rows, key=lambda r: r["stage"])
    resident = all("resident_bytes" in r for r in rows) and rows
    muon = {p.stage.index: sum(1 for f in p.stage.params if f in routes and routes[f].muon)
            for p in programs if hasattr(p, "f")} if routes else None
    head = f"{'stage':>5} {'rank':>4} {'params':>6} " + (f"{'muon':>5} " if muon else "") + \
           f"{'param mem':>10} {'F GFLOP':>8} {'I GFLOP':>8} {'W GFLOP':>8} " \
           f"{'saved/mb':>10} {'backward':>9} " + (f"{'offload/step':>12} " if offloaded is not None else "") + \
           f"{'bytes in':>10} {'bytes out':>10}" + (f" {'rank holds':>10}" if resident else "")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['stage']:>5} {r['rank']:>4} {r['params']:>6} "
                     + (f"{muon.get(r['stage'], 0):>5} " if muon else "") + f"{_fmt_bytes(r['param_bytes']):>10} "
                     f"{r['fwd_gflop']:>8.4f} {r['i_gflop']:>8.4f} {r['w_gflop']:>8.4f} "
                     f"{_fmt_bytes(r['saved_bytes']):>10} {r.get('backward', '?'):>9} "
                     + (f"{_fmt_bytes(offloaded.get(r['stage'], 0)):>12} " if offloaded is not None else "")
                     + f"{_fmt_bytes(r['bytes_in']):>10} "
                     f"{_fmt_bytes(r['bytes_out']):>10}"
                     + (f" {_fmt_bytes(r['resident_bytes']):>10}" if resident else ""))
    if resident:
        lines.append("(rank holds: the real parameter storage of that rank's process, masters and shards included; "
                     "the rest of the model stays on the meta device)")
    return "\n".join(lines)


def dump_programs(programs, schedule, plan, directory: str) -> list[str]:
    """stageN_{F,I,W,B}.py (the programs as split), .exec.py (as the runtime runs them) and
    stages.txt, for the stages whose programs this process holds."""
    from autopar.runtime.execute import executed_code

    paths = []
    for prog in programs:
        if not hasattr(prog, "f"):
            continue  # another pipeline rank's stage
        s = prog.stage.index
        for kind, p in (("F", prog.f), ("I", prog.i), ("W", prog.w), ("B", prog.b)):
            path = os.path.join(directory, f"stage{s}_{kind}.py")
            with open(path, "w") as fh:
                fh.write(f"# autopar stage {s} {kind} program\n# args (runtime keys): {list(p.args)}\n"
                         f"# results (runtime keys): {list(p.results)}\n# GFLOP: {p.flops / 1e9:.6f}\n")
                fh.write(p.code)
            paths.append(path)
            path = os.path.join(directory, f"stage{s}_{kind}.exec.py")
            with open(path, "w") as fh:  # the same program as the runtime runs it
                fh.write(f"# autopar stage {s} {kind} program as executed (passes/exec_code.py: peepholes, "
                         f"ops bound once to their C++ entry points)\n")
                fh.write(executed_code(p))
            paths.append(path)
    path = os.path.join(directory, "stages.txt")
    with open(path, "w") as fh:
        if plan is not None:
            fh.write("plan:\n" + plan.table() + "\n\n")
        fh.write(stage_table(programs, schedule) + "\n")
        if plan is not None and plan.compile:
            from autopar.runtime.compiled import compile_report, inductor_output

            fh.write(f"\nInductor: {compile_report(programs)}\n(programs not yet called compile at their first "
                     f"call); its generated code and on-disk cache: {inductor_output()}\n")
    paths.append(path)
    return paths


def dump_steps(schedule, directory: str) -> list[str]:
    """rankN_step.py: the generated step of every pipeline rank (runtime/codegen.py)."""
    from autopar import schedules
    from autopar.runtime.codegen import generate_source

    paths = []
    for r, acts in enumerate(schedules.lower(schedule).actions):
        path = os.path.join(directory, f"rank{r}_step.py")
        with open(path, "w") as fh:
            fh.write(f"# autopar: what pipeline rank {r} runs each step ({schedule.name}, "
                     f"{schedule.num_microbatches} microbatches); rt is runtime.distributed.DistributedPipeline\n")
            fh.write(generate_source(acts, schedule.stage_to_rank, r))
        paths.append(path)
    return paths
