"""The planner's output: a terminal report (tables) and one JSON object (design.md §4)."""
from __future__ import annotations

import re
from dataclasses import replace

import sympy

from .estimate import Estimate, GiB, offload_label
from .search import Candidate, PlanResult


def stage_rows(res: PlanResult, est: Estimate) -> list[dict]:
    units = res.evaluator.units
    b = est.partition.bounds
    rows = []
    for s in range(len(b) - 1):
        first, last = units[b[s]].name, units[b[s + 1] - 1].name
        rows.append({
            "stage": s, "rank": est.stage_to_rank[s], "units": [b[s], b[s + 1]],
            "first": first, "last": last, "recompute": est.partition.recompute[s],
            "F_s": est.stage_costs.f[s], "I_s": est.stage_costs.i[s], "W_s": est.stage_costs.w[s],
        })
    return rows


def memory_formula(res: PlanResult, est: Estimate, rank: int) -> sympy.Expr:
    """Rank memory in bytes as a function of microbatch size b and sequence length s.

    Saved activations, transient working sets and P2P buffers are linear in the tokens of a
    microbatch (b*s, attention runs as a flash kernel); parameters, gradients, optimizer
    states, buffers and the runtime overhead are not. The gradient-reduction buffers (DP
    buckets, ZeRO-1's flat buffers) come after the backward, so the peak is the larger of the
    pipeline phase (activations + working set + grad outputs) and those buffers: a ``Max``.
    """
    b, s = sympy.symbols("b s", positive=True)
    row = est.memory[rank]
    lay = est.layout
    tokens = lay.b * (res.evaluator.profile.seq_len or 1)
    phase = ("activations", "moe receive", "working", "logits/loss")
    reduction = ("dp buckets", "zero-1 buffers")
    static = sum(v for k, v in row.items() if k not in phase + reduction + ("p2p buffers", "grad outputs"))
    p2p = sympy.Float(row["p2p buffers"] / tokens, 6) * b * s
    pipeline_phase = sympy.Float(sum(row[k] for k in phase) / tokens, 6) * b * s + sympy.Float(row["grad outputs"], 12)
    ev = res.evaluator.for_tp(lay.tp)
    name, red = ev.reduction_bytes(lay, ev.rank_params(lay, est.partition, est.stage_to_rank, rank))
    peak = pipeline_phase if name not in reduction else sympy.Max(pipeline_phase, sympy.Float(red, 12))
    return sympy.Float(round(static), 12) + p2p + peak


def _gib(x: float) -> str:
    return f"{x / GiB:.2f}"


def _layout_dict(c: Candidate) -> dict:
    lay = c.layout
    return {"pp": lay.pp, "dp": lay.dp, "cp": lay.cp, "ep": lay.ep, "tp": lay.tp,
            "sequence_parallel": lay.sequence_parallel, "schedule": lay.schedule,
            "stages_per_rank": lay.v, "num_microbatches": lay.m, "microbatch_size": lay.b, "zero": lay.zero,
            "loss_chunk_tokens": c.loss_chunk, "offload": c.offload,
            "remake": True if c.remake else None}  # (as to_plan: None follows compile)


def candidate_dict(c: Candidate) -> dict:
    d = _layout_dict(c)
    d["status"] = c.status
    d["reason"] = c.reason
    if c.estimate is not None:
        d["predicted_step_time_s"] = c.estimate.step_time
        d["peak_memory_bytes"] = [float(x) for x in c.estimate.peak_memory]
        d["recompute_stages"] = [i for i, r in enumerate(c.estimate.partition.recompute) if r]
    elif c.peaks is not None:
        d["peak_memory_bytes"] = [float(x) for x in c.peaks]
    return d


def to_json(res: PlanResult, profile_info: dict, top: int = 5, include_all: bool = False) -> dict:
    c = res.chosen
    out: dict = {"model": res.evaluator.profile.name, "gpus": res.request.gpus,
                 "device": res.evaluator.device.name, "global_batch": res.request.global_batch,
                 "seq_len": res.evaluator.profile.seq_len, "precision": res.evaluator.precision.name,
                 "memory_limit_bytes": res.request.memory_limit, "feasible": c is not None}
    out.update(profile_info)
    out["compile"] = res.evaluator.profile.compiled
    out["search_s"] = res.search_s
    out["solver"] = solver_summary(res)
    if c is not None:
        est = c.estimate
        out.update(_layout_dict(c))
        rows = stage_rows(res, est)
        out["stage_boundaries"] = [[r["first"], r["last"]] for r in rows]
        out["stage_units"] = [r["units"] for r in rows]
        out["stage_to_rank"] = list(est.stage_to_rank)
        if profile_info.get("packed"):
            out["real_tokens_per_s"] = real_tokens_per_s(profile_info["packed"], c)
        out["recompute_stages"] = [r["stage"] for r in rows if r["recompute"]]
        from .search import plan_moe_imbalance

        imb = plan_moe_imbalance(res.evaluator, c.layout)
        if imb is not None:  # the imbalance the plan was priced at (Plan.moe_imbalance)
            out["moe_imbalance"] = imb
        units = res.evaluator.units
        if all(u.cut is not None for u in units):
            out["stage_cuts"] = [units[b].cut for b in est.partition.bounds[1:-1]]
        out["predicted_step_time_s"] = est.step_time
        out["predicted_breakdown_s"] = {"pipeline": est.makespan_s, "dp_exposed": est.dp_exposed_s,
                                        "optimizer": est.optimizer_s}
        out["tokens_per_s"] = est.tokens_per_s
        out["mfu"] = est.mfu
        out["bubble"] = est.bubble
        out["peak_memory_bytes"] = [float(x) for x in est.peak_memory]
        out["memory_breakdown_bytes"] = [{k: float(v) for k, v in row.items()} for row in est.memory]
        if est.host_bytes:
            out["offload_host_bytes"] = [float(x) for x in est.host_bytes]
            out["offload_exposed_s"] = [float(x) for x in est.offload_exposed_s]
        out["memory_formula"] = [str(memory_formula(res, est, r)) for r in range(len(est.memory))]
        out["stages"] = rows
    alts = [x for x in res.feasible() if x is not c][:top]
    others = sorted((x for x in res.candidates if x.status == "oom"), key=lambda x: x.peak)[:top]
    rej = _distinct_rejections(res, top)
    out["alternatives"] = [candidate_dict(x) for x in alts + others + rej]
    if include_all:
        out["candidates"] = [candidate_dict(x) for x in res.feasible()]
    if c is None:
        close = res.closest()
        if close is not None:
            out["closest"] = candidate_dict(close)
            out["min_memory_needed_bytes"] = float(close.peak)
    return out


def solver_summary(res: PlanResult) -> dict:
    runs = res.ilp_runs
    gaps = [r.gap for r in runs if r.gap is not None]
    from .ilp import solver_name

    return {"solver": solver_name(), "ilp_solves": len(runs), "statuses": sorted({r.status for r in runs}),
            "solver_s": res.solver_s, "max_gap_vs_balanced_bound": max(gaps) if gaps else None,
            "simulated": sum(1 for c in res.candidates if c.estimate is not None),
            "memory_checked": sum(1 for c in res.candidates if c.estimate is None and c.peaks is not None),
            "layouts": sum(1 for c in res.candidates if c.status != "rejected")}


_TEXT_COLS = {"stage", "rank", "pp", "why not chosen"}


def _table(header: list[str], rows: list[list]) -> list[str]:
    cells = [header] + [[str(x) for x in r] for r in rows]
    w = [max(len(r[i]) for r in cells) for i in range(len(header))]
    out = ["  " + "  ".join(h.ljust(w[i]) for i, h in enumerate(header)).rstrip()]
    last = len(header) - 1  # first and last columns are text (left-aligned), the rest numbers
    out += ["  " + "  ".join(r[i].ljust(w[i]) if i in (0, last) and header[i] in _TEXT_COLS else r[i].rjust(w[i])
                             for i in range(len(r))).rstrip() for r in cells[1:]]
    return out


def _collapse(rows: list[list], ranged: tuple[int, ...], keep_first: tuple[int, ...] = (),
              keep_last: tuple[int, ...] = ()) -> list[list]:
    """Merge runs of rows equal outside the ``ranged``/``keep_*`` columns: ``ranged`` columns
    become "a-b", ``keep_first``/``keep_last`` columns show the run's first/last value."""
    skip = set(ranged) | set(keep_first) | set(keep_last)
    out: list[list] = []
    start = None
    for r in rows:
        sig = [x for i, x in enumerate(r) if i not in skip]
        if out and start is not None and sig == [x for i, x in enumerate(start) if i not in skip]:
            last = out[-1]
            for i in ranged:
                last[i] = f"{str(last[i]).split('-')[0]}-{r[i]}"
            for i in keep_last:
                last[i] = r[i]
        else:
            out.append(list(r))
            start = r
    return out


def _distinct_rejections(res: PlanResult, top: int) -> list[Candidate]:
    """Up to ``top`` rejected layouts with different reasons (numbers aside)."""
    seen, out = set(), []
    for c in res.candidates:
        if c.status != "rejected":
            continue
        key = re.sub(r"[0-9.]+", "#", c.reason)
        if key not in seen:
            seen.add(key)
            out.append(c)
    return out[:top]


def pin_report(res: PlanResult, c: Candidate) -> list[str]:
    """For a pinned layout that does not fit: its heaviest rank's memory by component, how far
    over the limit, and what the planner's memory features do to it (evaluated: no stage vs every
    stage recomputing at the same boundaries, higher ZeRO levels, activation offload)."""
    from .estimate import Partition
    from .search import _unit_totals, balanced_partition

    ev, lay = res.evaluator.for_tp(c.layout.tp), c.layout
    S = lay.num_stages
    bounds = c.estimate.partition.bounds if c.estimate is not None else \
        balanced_partition(_unit_totals(ev, lay), S)
    out = ["", f"pinned layout {lay.label()}: per-rank memory, GiB (limit {ev.memory_limit / GiB:.2f})"]
    ests = {rc: ev.evaluate(lay, Partition(bounds, (rc,) * S)) for rc in (False, True)}
    est = ests[True]
    keys = list(est.memory[0].keys())
    rows = [[r] + [_gib(est.memory[r][k]) for k in keys] + [_gib(est.peak_memory[r])] for r in range(len(est.memory))]
    out += _table(["rank"] + keys + ["total"], _collapse(rows, ranged=(0,)))
    r, over = est.oom()
    out.append(f"  with every stage recomputing: rank {r} needs {est.peak_memory[r] / GiB:.2f} GiB, "
               f"{over / GiB:.2f} GiB over the limit")
    plain = ests[False]
    out.append(f"  recomputation: {max(plain.peak_memory) / GiB:.2f} GiB without it -> "
               f"{max(est.peak_memory) / GiB:.2f} GiB with every stage recomputing "
               f"({(max(plain.peak_memory) - max(est.peak_memory)) / GiB:.2f} GiB saved; "
               + ("closes it)" if est.feasible else f"{over / GiB:.2f} GiB still over)"))
    for z in (1, 2, 3):
        if z > lay.zero and lay.dp * lay.cp > 1:
            import dataclasses

            other = ev.evaluate(dataclasses.replace(lay, zero=z), Partition(bounds, (True,) * S))
            out.append(f"  ZeRO-{z} (pin zero={z}): {max(other.peak_memory) / GiB:.2f} GiB "
                       + ("(fits)" if other.feasible else f"({-(ev.memory_limit - max(other.peak_memory)) / GiB:.2f} "
                                                          "GiB over)"))
    for f in (0.5, 1.0):
        other = ev.evaluate(replace(lay, offload=f), Partition(bounds, (True,) * S))
        out.append(f"  activation offload {f:g} (Plan(offload={f:g})): {max(other.peak_memory) / GiB:.2f} GiB "
                   + ("(fits)" if other.feasible else f"({(max(other.peak_memory) - ev.memory_limit) / GiB:.2f} GiB "
                                                      "over)"))
    if not other.feasible:
        out += beyond_lines(ev, other)
    return out


def beyond_lines(ev, est: Estimate) -> list[str]:
    """What memory features autopar lacks would do to ``est`` (every feature it has on): on the
    heaviest rank, the rows MoE dispatches received (their op holds them from F to W: neither
    offloaded nor recomputed) and FP8 activation caching (the saved activations and those rows
    kept in 8 bits instead of 16: half of them), evaluated against the limit."""
    r, over = est.oom()
    row = est.memory[r]
    moe, act = row["moe receive"], row["activations"]
    out = []
    if moe > 0:
        out.append(f"  not in autopar: the MoE dispatch's received rows ({moe / GiB:.2f} GiB on rank {r}) stay on "
                   "the device from F to W (the op holds them: not offloaded, never recomputed)")
    if ev.precision.weight == 2 and act + moe > 0:
        saved = (act + moe) / 2
        out.append(f"  not in autopar: FP8 activation caching (saved activations and MoE rows in 8 bits) would save "
                   f"about {saved / GiB:.2f} GiB on rank {r}: "
                   + ("it would fit" if saved >= over else f"still {(over - saved) / GiB:.2f} GiB over"))
    return out


def loss_lines(res: PlanResult, c: Candidate) -> list[str]:
    """What the plan does with the LM head + cross-entropy (when the model has one the chunked
    loss can take): chunked or not, and the last unit's working set both ways."""
    ev = res.evaluator.for_tp(c.layout.tp)
    chunked = ev.profile.chunked
    if chunked is None:
        return []
    sc = ev.scale(c.layout)
    plain, small = ev.units[-1].kind.work(sc), chunked.units[-1].kind.work(sc)
    if c.loss_chunk:
        return [f"  cross-entropy chunked at {c.loss_chunk} tokens: the last unit's working set "
                f"{small / GiB:.2f} GiB instead of {plain / GiB:.2f} GiB with the whole logits (memory binds)"]
    return [f"  cross-entropy as captured: the last unit's working set {plain / GiB:.2f} GiB with the whole logits "
            f"({small / GiB:.2f} GiB chunked at {chunked.loss_chunk_tokens} tokens; not used: this plan fits "
            "faster without it)"]


def compile_lines(res: PlanResult) -> list[str]:
    """Whether the plan runs its programs compiled (``--compile``) and what its unit times are."""
    prof = res.evaluator.profile
    if not prof.compiled:
        return []
    how = ("units timed compiled on this machine" if prof.unit_timer is not None
           else "units priced per op as uncompiled: the device model does not model Inductor's fusion")
    return [f"  stage programs compiled by Inductor (Plan(compile=True)); {how}"]


def remake_lines(res: PlanResult, c: Candidate) -> list[str]:
    """Whether the plan's backward makes element-wise values again (``Plan.remake``), and what F
    keeps per microbatch over all its units both ways."""
    ev = res.evaluator.for_tp(c.layout.tp)
    if ev.profile.compiled:
        return ["  element-wise values: made again in the backward on every stage (compiled: fused into the "
                "kernels that read them)"]
    remade = ev.remade
    if remade is None:
        return []
    sc = ev.scale(c.layout)
    kept, again = (sum(u.kind.saved_bytes for u in e.units) * sc / GiB for e in (ev, remade))
    if c.remake:
        return [f"  element-wise values made again in the backward on every stage: F keeps {again:.2f} GiB a "
                f"microbatch over the model instead of {kept:.2f} GiB (memory binds)"]
    return [f"  element-wise values kept from F: {kept:.2f} GiB a microbatch over the model ({again:.2f} GiB made "
            "again in the backward; not used: this plan fits faster without it)"]


def offload_lines(res: PlanResult, c: Candidate) -> list[str]:
    """The activation offload of the plan: the share (per stage when they differ), and per pp
    rank the most bytes parked on the host at once and the copy time compute does not hide
    (past 8 ranks or stages: the extremes; ``--json`` has every one)."""
    if not c.offload:
        return ["  activation offload: not used (this plan fits faster without it)"] if res.evaluator.offloading else []
    est = c.estimate
    if not isinstance(c.offload, tuple):
        share = f"{c.offload:g} of every stage's saved activations"
    elif len(c.offload) <= 8:
        share = f"per stage {offload_label(c.offload)} of its saved activations"
    else:
        used = [s for s, f in enumerate(c.offload) if f]
        hi, lo = max(used, key=lambda s: (c.offload[s], -s)), min(used, key=lambda s: (c.offload[s], s))
        share = (f"on {len(used)} of {len(c.offload)} stages, from {c.offload[hi]:.3g} (stage {hi}) to "
                 f"{c.offload[lo]:.3g} (stage {lo}) of their saved activations")
    if isinstance(c.offload, tuple):
        share += " (per stage the least that fits, the stages whose microbatches wait longest first)"
    pairs = list(zip(est.host_bytes, est.offload_exposed_s))
    if len(pairs) <= 8:
        per_rank = ", ".join(f"rank {r}: {h / GiB:.2f} GiB parked, {t * 1e3:.3g} ms exposed"
                             for r, (h, t) in enumerate(pairs))
    else:
        r_h = max(range(len(pairs)), key=lambda r: pairs[r][0])
        r_t = max(range(len(pairs)), key=lambda r: pairs[r][1])
        per_rank = (f"{sum(h > 0 for h, _ in pairs)} of {len(pairs)} ranks park; the most: rank {r_h}, "
                    f"{pairs[r_h][0] / GiB:.2f} GiB; the most exposed copy time: rank {r_t}, "
                    f"{pairs[r_t][1] * 1e3:.3g} ms")
    return [f"  activation offload: {share} on the host between F and I/W ({per_rank})"]


def optimizer_lines(res: PlanResult, c: Candidate) -> list[str]:
    """Muon's part of the plan (``--optimizer muon``): its matrices, the momentum bytes it saves
    against Adam and the Newton-Schulz time, on the rank that steps the most."""
    ev = res.evaluator.for_tp(c.layout.tp)
    if ev.optimizer != "muon":
        return []
    prof, lay, est = ev.profile, c.layout, c.estimate
    total = sum(u.kind.muon_params for u in prof.units)
    kinds, s2r = ev.stage_kinds(est.partition), est.stage_to_rank
    held = {r: [k for s in range(len(kinds)) if s2r[s] == r for k in kinds[s]] for r in sorted(set(s2r))}
    worst = max(held, key=lambda r: sum(ev.muon_shards(k, lay)[1] for k in held[r]))
    saved = sum(ev.muon_state_saving(k, lay) for k in held[worst])
    dealt = ev.muon_dealt(lay, est.partition, s2r, worst)  # the replica of that rank that steps the most
    flops = dealt[1] if dealt else sum(ev.muon_shards(k, lay)[1] for k in held[worst])
    share = total / max(prof.total_params, 1)
    return [f"  optimizer: Muon on {total / 1e9:.3g}B hidden-matrix elements ({share:.0%}), "
            f"AdamW on the rest; pp rank {worst}: {saved / GiB:.2f} GiB less optimizer state than Adam "
            "(one momentum an element; ZeRO-2/3's whole-matrix shard padding is in the memory table), Newton-Schulz "
            f"{flops / 1e12:.3g} TFLOP ({flops / ev.device.flops_rate('bfloat16') * 1e3:.3g} ms) a step"]


def packed_lines(profile_info: dict, c: Candidate) -> list[str]:
    """``--lengths``: the documents packed into the plan's rows and the real tokens per second."""
    p = profile_info.get("packed")
    if not p:
        return []
    return [f"  packed documents ({p['file']}): {p['documents']:,} documents, {p['tokens']:,} tokens in "
            f"{p['rows']:,} rows of {p['seq_len']}: {p['fill']:.1%} real tokens, {real_tokens_per_s(p, c):,.0f} "
            f"real tokens/s; attention within documents is {p['attention_share']:.1%} of full rows' pairs (priced "
            "at full rows: a dense document mask computes every pair)"]


def real_tokens_per_s(packed: dict, c: Candidate) -> float:
    return c.estimate.tokens_per_s * packed["fill"]


def _why_lost(c: Candidate) -> str:
    return c.reason or c.status


def text(res: PlanResult, profile_info: dict, top: int = 5, include_all: bool = False) -> str:
    ev, req = res.evaluator, res.request
    prof = ev.profile
    L = [f"autopar plan: {prof.name} on {req.gpus} x {ev.device.name} "
         f"({req.memory_limit / GiB:.1f} GiB each), global batch {req.global_batch}"
         + (f" x {prof.seq_len} tokens" if prof.seq_len else ""),
         f"  {prof.total_params / 1e9:.3g}B parameters in {len(prof.units)} units "
         f"({len(prof.kinds)} distinct); {ev.precision.name}",
         ("  model profile from the disk cache (--no-cache to capture again), "
          if profile_info.get("profile_cached") else
          f"  capture {profile_info.get('capture_s', 0):.1f} s, unit traces {profile_info.get('trace_s', 0):.1f} s, ")
         + f"search {res.search_s:.2f} s (of which ILP {res.solver_s:.2f} s)"]
    s = solver_summary(res)
    gap = s["max_gap_vs_balanced_bound"]
    L.append(f"  solver: {s['ilp_solves']} stage-boundary ILPs ({s['solver']}): {', '.join(s['statuses']) or '-'}; "
             f"largest gap to the perfectly balanced bound {'-' if gap is None else f'{gap * 100:.1f}%'}; "
             f"{s['simulated']} of {s['layouts']} layouts simulated, {s['memory_checked']} more found over the "
             "limit by memory alone")
    c = res.chosen
    if c is None:
        L.append("")
        L.append("NO PLAN FITS.")
        close = res.closest()
        if close is not None:
            need = close.peak
            L.append(f"  the smallest per-device memory any simulated plan needs is {need / GiB:.2f} GiB "
                     f"(limit {req.memory_limit / GiB:.2f} GiB)")
            L.append(f"  closest plan: {close.layout.label()} ({close.reason})")
            if res.request.pin:
                L += pin_report(res, close)
        L.append("  fix: more devices (--gpus), a device with more memory (--device/--memory), "
                 "or a smaller --global-batch / --seq")
        return "\n".join(L)
    est = c.estimate
    lay = c.layout
    L += ["", "chosen plan",
          f"  tp {lay.tp}  pp {lay.pp}  dp {lay.dp}  cp {lay.cp}  ep {lay.ep}  schedule {lay.schedule} ({lay.v} stage"
          f"{'s' if lay.v > 1 else ''}/rank)  microbatches {lay.m} x {lay.b} samples  ZeRO {lay.zero}",
          *loss_lines(res, c),
          *remake_lines(res, c),
          *offload_lines(res, c),
          *compile_lines(res),
          *optimizer_lines(res, c),
          *packed_lines(profile_info, c),
          f"  predicted step {est.step_time:.4g} s (pipeline {est.makespan_s:.4g} + dp {est.dp_exposed_s:.3g} + "
          f"optimizer {est.optimizer_s:.3g})  tokens/s {est.tokens_per_s:,.0f}  MFU {est.mfu * 100:.1f}%  "
          f"bubble {est.bubble * 100:.1f}%", "", "stages"]
    rows = stage_rows(res, est)
    srows = [[r["stage"], r["rank"], r["first"], r["last"], r["units"][1] - r["units"][0],
              "yes" if r["recompute"] else "no", f"{r['F_s'] * 1e3:.3g}", f"{r['I_s'] * 1e3:.3g}",
              f"{r['W_s'] * 1e3:.3g}"] for r in rows]
    if lay.v == 1:  # one stage per rank: runs of identical stages print as one row
        srows = _collapse(srows, ranged=(0, 1), keep_first=(2,), keep_last=(3,))
    L += _table(["stage", "rank", "first", "last", "units", "recompute", "F ms", "I ms", "W ms"], srows)
    L += ["", f"memory per pp rank, GiB (limit {req.memory_limit / GiB:.2f})"]
    keys = list(est.memory[0].keys())
    rows = [[r] + [_gib(est.memory[r][k]) for k in keys]
            + [_gib(est.peak_memory[r]), _gib(req.memory_limit - est.peak_memory[r])] for r in range(len(est.memory))]
    L += _table(["rank"] + keys + ["total", "headroom"], _collapse(rows, ranged=(0,)))
    worst = max(range(len(est.peak_memory)), key=est.peak_memory.__getitem__)
    L.append(f"  rank {worst} (heaviest): M(b, s) = {memory_formula(res, est, worst)} bytes "
             f"at b={lay.b}, s={prof.seq_len}")
    alts = [x for x in res.feasible() if x is not c][:top]
    ooms = sorted((x for x in res.candidates if x.status == "oom"), key=lambda x: x.peak)[:top]
    rej = _distinct_rejections(res, top)
    L += ["", f"alternatives (top {top} feasible, then the closest that do not fit, then rejected layouts)"]
    L += _table(["tp", "pp", "dp", "cp", "ep", "schedule", "m", "b", "zero", "step s", "peak GiB", "why not chosen"],
                [[x.layout.tp, x.layout.pp, x.layout.dp, x.layout.cp, x.layout.ep, x.layout.schedule, x.layout.m,
                  x.layout.b, x.layout.zero, f"{x.time:.4g}" if x.estimate else "-",
                  _gib(x.peak) if x.peak is not None else "-", _why_lost(x)]
                 for x in alts + ooms + rej])
    if include_all:
        feas = res.feasible()
        L += ["", f"every feasible candidate ({len(feas)})"]
        L += _table(["tp", "pp", "dp", "cp", "ep", "schedule", "v", "m", "b", "zero", "step s", "peak GiB"],
                    [[x.layout.tp, x.layout.pp, x.layout.dp, x.layout.cp, x.layout.ep, x.layout.schedule, x.layout.v,
                      x.layout.m, x.layout.b, x.layout.zero, f"{x.time:.6g}", _gib(max(x.estimate.peak_memory))]
                     for x in feas])
    return "\n".join(L)
