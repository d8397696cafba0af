"""Planner: properties of chosen plans (P2), the ILP against brute force, the report (P6) and
infeasible requests (P5)."""
from __future__ import annotations

import itertools
import json
import math

import pytest
import sympy
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from autopar.planner import plan_model, presets
from autopar.planner.cli import main as plan_main
from autopar.planner.cli import parse_bytes
from autopar.planner.devices import get_profile
from autopar.planner.estimate import Evaluator, GiB, Layout, Partition
from autopar.planner.ilp import live_vectors, solve_partition
from autopar.planner.profile import profile_model
from autopar.planner.report import memory_formula, text, to_json
from autopar.planner.search import Request, balanced_partition, plan, price
from autopar.schedules import build, simulate

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def gpt_profile():
    from autopar.examples.gpt import make_gpt

    model, inputs, target, loss = make_gpt(n_layer=4, d_model=32, n_head=2, seq_len=16, batch_size=2)
    return profile_model(model, inputs, target, loss, name="gpt", n_heads=2)


@pytest.fixture(scope="module")
def mixtral_profile():
    pm = presets.build_preset("mixtral-8x7b", seq_len=256)
    return profile_model(pm.model, pm.inputs, pm.target, pm.loss_fn, name=pm.name, layer_repeats=pm.layer_repeats,
                         expert_prefixes=pm.expert_param_prefixes, n_heads=pm.n_heads, n_experts=pm.n_experts,
                         seq_len=256)


def test_profile_units(gpt_profile):
    names = [u.name for u in gpt_profile.units]
    assert names == ["prologue", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "epilogue"]
    blocks = [u.kind for u in gpt_profile.units[1:5]]
    assert all(k is blocks[0] for k in blocks), "identical blocks share one traced kind"
    assert all(u.cut is not None for u in gpt_profile.units)
    k = blocks[0]
    assert k.f.total_flops > 0 and k.i.total_flops > 0 and k.w.total_flops > 0
    # tied embedding / head: counted once in total_params
    from autopar.examples.gpt import make_gpt

    model = make_gpt(n_layer=4, d_model=32, n_head=2, seq_len=16, batch_size=2)[0]
    assert gpt_profile.total_params == sum(p.numel() for p in model.parameters())


def test_preset_profile_expands_repeats(mixtral_profile):
    assert len(mixtral_profile.units) == 32 + 2
    assert abs(mixtral_profile.total_params - presets.parameter_count("mixtral-8x7b")) / 46.7e9 < 0.01
    moe = mixtral_profile.units[1].kind
    assert moe.expert_params > 0.9 * moe.params and moe.dispatch_bytes > 0 and moe.attention_bytes > 0


# ---------------------------------------------------------------------------------------------
# P2: properties of the chosen plan


def _check_plan(res, prof, req):
    c = res.chosen
    assert c is not None
    lay, est = c.layout, c.estimate
    assert lay.pp * lay.dp * lay.cp == req.gpus
    assert (lay.dp * lay.cp) % lay.ep == 0
    assert req.global_batch == lay.dp * lay.m * lay.b
    # every rank within the limit under its own accounting
    for r, row in enumerate(est.memory):
        assert math.isclose(sum(row.values()), est.peak_memory[r], rel_tol=1e-9)
        assert est.peak_memory[r] <= req.memory_limit
    # predicted time = the simulator's makespan for this plan + the DP and optimizer terms
    sched = est.schedule_obj
    sim = simulate(sched, est.stage_costs, p2p_latency=est.p2p_link[0], p2p_bandwidth=est.p2p_link[1],
                   message_bytes=est.message_bytes)
    assert math.isclose(sim.makespan, est.makespan_s, rel_tol=1e-12)
    assert math.isclose(est.step_time, sim.makespan + est.dp_exposed_s + est.optimizer_s, rel_tol=1e-12)
    # no feasible candidate listed is faster
    for other in res.feasible():
        assert other.time >= c.time - 1e-15
    # stage boundaries cover every unit once, in order
    b = est.partition.bounds
    assert b[0] == 0 and b[-1] == len(prof.units) and all(x < y for x, y in zip(b, b[1:]))
    assert len(b) - 1 == lay.pp * lay.v


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(gpus=st.sampled_from([1, 2, 4]), batch=st.sampled_from([8, 16]),
       limit_mb=st.sampled_from([2, 8, 64]), device=st.sampled_from(["h100", "a100-80gb"]))
def test_chosen_plan_properties(gpt_profile, gpus, batch, limit_mb, device):
    req = Request(gpus=gpus, global_batch=batch, memory_limit=limit_mb * 2**20, exhaustive=True)
    res = plan(gpt_profile, get_profile(device), req)
    if res.chosen is None:  # then nothing simulated fits
        assert not res.feasible()
        return
    _check_plan(res, gpt_profile, req)
    again = plan(gpt_profile, get_profile(device), req)
    assert (again.chosen.layout, again.chosen.estimate.partition) == (res.chosen.layout, res.chosen.estimate.partition)


def test_moe_plan_properties_and_ep(mixtral_profile):
    req = Request(gpus=64, global_batch=64, memory_limit=80e9)
    res = plan(mixtral_profile, get_profile("h100"), req)
    _check_plan(res, mixtral_profile, req)
    assert any(c.layout.ep > 1 for c in res.candidates if c.estimate is not None), "EP layouts are priced"


def test_memory_formula_matches_estimate(gpt_profile):
    res = plan(gpt_profile, get_profile("h100"), Request(gpus=2, global_batch=8, memory_limit=8e9))
    est = res.chosen.estimate
    b, s = sympy.symbols("b s", positive=True)
    for r in range(len(est.memory)):
        expr = memory_formula(res, est, r)
        val = float(expr.subs({b: est.layout.b, s: gpt_profile.seq_len}))
        assert math.isclose(val, est.peak_memory[r], rel_tol=1e-5, abs_tol=2)


# ---------------------------------------------------------------------------------------------
# the ILP against brute force


def _brute_force(ev, lay, sched, frac, limit):
    """Every contiguous cut and recompute choice: the smallest busiest-rank time that fits the
    ILP's own memory accounting (live vectors x saved bytes + static + fixed terms)."""
    from autopar.planner.ilp import _fixed_memory, ilp_unit_static

    U, S = len(ev.units), lay.num_stages
    s2r = sched.stage_to_rank
    vecs = live_vectors(sched, frac)
    sc = ev.scale(lay)
    best = math.inf
    for cuts in itertools.combinations(range(1, U), S - 1):
        bounds = (0, *cuts, U)
        for rc in itertools.product([False, True], repeat=S):
            load = [0.0] * lay.pp
            act = []
            for s in range(S):
                kinds = [u.kind for u in ev.units[bounds[s]:bounds[s + 1]]]
                t = sum(sum(ev.unit_times(k, lay)) for k in kinds)
                if rc[s]:
                    t += sum(ev.unit_times(k, lay)[0] for k in kinds)
                load[s2r[s]] += t
                act.append(max(k.in_bytes for k, _ in ev.profile.runs()) * sc if rc[s]
                           else sum(k.saved_bytes for k in kinds) * sc)
            ok = True
            for r in range(lay.pp):
                stages = [s for s in range(S) if s2r[s] == r]
                static = sum(ilp_unit_static(ev, u.kind, lay) for s in stages for u in ev.units[bounds[s]:bounds[s + 1]])
                held = [u.kind for s in stages for u in ev.units[bounds[s]:bounds[s + 1]]]
                fixed = sum(_fixed_memory(ev, lay, max(k.work_bytes for k in held) * sc,
                                          max(max(k.out_bytes, k.in_bytes) for k in held) * sc).values())
                for v in vecs[r]:
                    if static + sum(c * act[s] for s, c in v.items()) + fixed > limit * (1 + 1e-9):
                        ok = False
            if ok:
                best = min(best, max(load))
    return best


@pytest.mark.parametrize("schedule,pp,m,limit_mb", [("1f1b", 2, 4, 64), ("zbv", 2, 4, 64), ("1f1b", 3, 3, 64),
                                                     ("gpipe", 2, 8, 3)])
def test_ilp_matches_brute_force(gpt_profile, schedule, pp, m, limit_mb):
    ev = Evaluator(gpt_profile, get_profile("h100"), limit_mb * 2**20, global_batch=m * 2)
    from autopar.schedules.registry import default_stages_per_rank

    v = default_stages_per_rank(schedule)
    lay = Layout(pp, 1, 1, 1, schedule, v, m, 2, 0)
    sched = build(schedule, pp, m, v)
    frac = 0.5
    res = solve_partition(ev, lay, sched, frac, time_limit=20)
    expected = _brute_force(ev, lay, sched, frac, ev.memory_limit)
    if expected == math.inf:
        assert res.partition is None and res.status == "infeasible"
        return
    assert res.status == "optimal"
    assert math.isclose(res.objective, expected, rel_tol=1e-5)
    assert 0.0 <= res.gap <= 1.0


def test_balanced_partition_is_optimal():
    for times, S in [([3, 1, 1, 1, 3], 3), ([1, 2, 3, 4, 5, 6], 3), ([5, 1, 1, 1, 1, 1, 1, 5], 4), ([1] * 7, 7)]:
        got = balanced_partition([float(t) for t in times], S)
        cost = max(sum(times[got[i]:got[i + 1]]) for i in range(S))
        best = min(max(sum(times[b[i]:b[i + 1]]) for i in range(S))
                   for cuts in itertools.combinations(range(1, len(times)), S - 1) for b in [(0, *cuts, len(times))])
        assert cost == best and len(got) == S + 1


def test_price_matches_search(gpt_profile):
    ev = Evaluator(gpt_profile, get_profile("cpu"), 1e9, 8)
    c = price(ev, Layout(2, 1, 1, 1, "1f1b", 1, 4, 2, 0))
    assert c.estimate is not None and c.estimate.feasible and c.estimate.step_time > 0


# ---------------------------------------------------------------------------------------------
# CLI: report (P6), JSON, infeasible (P5), errors


def test_cli_report_and_json(capsys):
    rc = plan_main(["--model", "autopar.examples.gpt:make_gpt", "--gpus", "2", "--global-batch", "16",
                    "--device", "h100", "--quiet"])
    out = capsys.readouterr().out
    assert rc == 0
    for key in ("chosen plan", "predicted step", "tokens/s", "MFU", "bubble", "memory per pp rank",
                "headroom", "M(b, s) =", "alternatives", "why not chosen", "solver:", "stages"):
        assert key in out, key
    rc = plan_main(["--model", "autopar.examples.gpt:make_gpt", "--gpus", "2", "--global-batch", "16",
                    "--device", "h100", "--quiet", "--json", "--all"])
    data = json.loads(capsys.readouterr().out)
    assert rc == 0
    for key in ("pp", "dp", "cp", "ep", "schedule", "num_microbatches", "stage_boundaries", "predicted_step_time_s",
                "peak_memory_bytes", "memory_limit_bytes", "alternatives", "candidates", "stage_cuts"):
        assert key in data, key
    assert data["pp"] * data["dp"] * data["cp"] == 2
    assert len(data["peak_memory_bytes"]) == data["pp"]
    assert all(c["predicted_step_time_s"] >= data["predicted_step_time_s"] for c in data["candidates"])


def test_cli_infeasible_exits_2(capsys):
    rc = plan_main(["--model", "autopar.examples.gpt:make_gpt", "--gpus", "2", "--global-batch", "16",
                    "--device", "h100", "--memory", "200KiB", "--quiet"])
    out = capsys.readouterr().out
    assert rc == 2
    assert "NO PLAN FITS" in out and "closest plan" in out
    assert "smallest per-device memory any simulated plan needs is" in out


def test_cli_errors(capsys):
    assert plan_main(["no-such-model", "--gpus", "8", "--global-batch", "8"]) == 2
    err = capsys.readouterr().err
    assert "no-such-model" in err and "llama3-8b" in err, err  # names the bad preset and the known ones
    assert plan_main(["llama3-8b", "--global-batch", "8"]) == 2
    assert "--gpus" in capsys.readouterr().err
    assert plan_main(["--model", "autopar.examples.gpt:nope", "--gpus", "2", "--global-batch", "8"]) == 2
    assert "no callable nope" in capsys.readouterr().err
    with pytest.raises(ValueError, match="80GiB"):
        parse_bytes("lots")
    assert parse_bytes("80GiB") == 80 * GiB and parse_bytes("1.5 GB") == 1.5e9


def test_plan_model_to_runtime_plan(gpt_profile):
    from autopar.planner.search import to_plan

    res = plan(gpt_profile, get_profile("cpu"), Request(gpus=2, global_batch=8, memory_limit=1e9,
                                                         zero_levels=(0, 1), allow_cp=False, allow_ep=False))
    p = to_plan(res, res.chosen)
    assert p.world_size == 2 and len(p.stage_cuts) == p.num_stages - 1


# ---------------------------------------------------------------------------------------------
# the planner reaches for CP and EP when nothing else fits (pins feasibility, not degrees)


def _plan_json(capsys, argv):
    rc = plan_main(argv + ["--quiet", "--json"])
    return rc, json.loads(capsys.readouterr().out)


def test_attention_heads_read_off_the_graph():
    """`autopar plan --model` gets the head count CP must divide from the captured attention:
    the test Llama has 4 query heads and 2 key/value heads repeated to 4 before attention."""
    from autopar.passes import capture
    from autopar.planner.profile import attention_heads
    from tests.models import ALL_CASES

    for name, heads in (("llama", 4), ("gpt", 4), ("skip", 0)):
        case = ALL_CASES[name]()
        assert attention_heads(capture(case.model, case.inputs, case.target, case.loss_fn).gm) == heads, name


def test_long_sequence_needs_cp(capsys):
    args = ["llama3-8b", "--gpus", "64", "--global-batch", "64", "--seq", "131072", "--schedules", "1f1b,zb-h1"]
    rc, data = _plan_json(capsys, args + ["--no-cp"])
    assert rc == 2 and not data["feasible"] and data["min_memory_needed_bytes"] > data["memory_limit_bytes"]
    rc, data = _plan_json(capsys, args)
    assert rc == 0 and data["cp"] > 1
    assert max(data["peak_memory_bytes"]) <= data["memory_limit_bytes"]


def test_deepseek_needs_ep(capsys):
    args = ["deepseek-v3", "--gpus", "256", "--global-batch", "256", "--seq", "1024", "--schedules", "1f1b,zb-h1"]
    rc, data = _plan_json(capsys, args + ["--no-ep"])
    assert rc == 2 and not data["feasible"]
    rc, data = _plan_json(capsys, args)
    assert rc == 0 and data["ep"] > 1 and (data["dp"] * data["cp"]) % data["ep"] == 0
