"""Planner: the cost and memory model against hand-derived figures, properties of chosen plans
(P2) and the search against an enumeration of every layout, the ILP against brute force, the
report (P6) and infeasible requests (P5)."""
from __future__ import annotations

import dataclasses
import itertools
import json
import math

import pytest
import sympy
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from autopar.planner import presets
from autopar.planner.cli import main as plan_main
from autopar.planner.cli import parse_bytes
from autopar.planner.devices import DeviceProfile, Link, get_profile
from autopar.planner.estimate import Evaluator, GiB, Layout, Partition
from autopar.planner.ilp import live_vectors, solve_partition
from autopar.planner.profile import ModelProfile, Unit, UnitKind, profile_model
from autopar.planner.programs import Program
from autopar.planner.report import memory_formula
from autopar.planner.search import Request, balanced_partition, plan, price
from autopar.schedules import build, registry

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
# the cost and memory model on a hand-made profile, against figures derived here by hand
#
# Device "toy": 1 TFLOP/s, 100 GB/s, 10 us per node, every link 100 us + 10 GB/s, no calibration
# factors. One unit kind, used twice ("blocks.0", "blocks.1"), captured at batch0 = 2 samples, so
# a microbatch of b = 2 has scale 1. Its F, I and W programs are one node each:
#   F: 1 GFLOP -> 10 us + max(1e9 / 1e12, 1e6 / 1e11) = 1.01 ms
#   I: 2 GFLOP -> 2.01 ms        W: 3 GFLOP -> 3.01 ms
# Per unit: 1M fp32 parameters in 2 tensors; F saves 8 MB, W still needs 10 MB after I (more than
# F saved: I's outputs that W reads), 1 MB in and out, 3 MB working set.

_F, _I, _W = 1.01e-3, 2.01e-3, 3.01e-3
_P = 1e6                          # parameters per unit
_OV, _BW = 1e-5, 1e11             # per-node overhead, memory bandwidth
_ALPHA, _LINK_BW = 1e-4, 1e10     # every link
_RUNTIME = 2 * GiB                # fixed per-process overhead on a non-cpu device


@pytest.fixture(scope="module")
def toy():
    def prog(flops):
        return Program(flops=(flops,), bytes_moved=(1e6,), dtypes=("float32",), views=(False,))

    dev = DeviceProfile(name="toy", peak_flops={"float32": 1e12, "bfloat16": 1e12, "float16": 1e12},
                        mem_bandwidth=_BW, memory_bytes=10**12, flops_efficiency=1.0, mem_efficiency=1.0,
                        op_overhead_s=_OV, intra=Link(_ALPHA, _LINK_BW), inter=Link(_ALPHA, _LINK_BW),
                        gpus_per_node=8, source="test")
    kind = UnitKind(kind="blk", f=prog(1e9), i=prog(2e9), w=prog(3e9), saved_bytes=8e6, saved_after_i=10e6,
                    in_bytes=1e6, out_bytes=1e6, params=int(_P), param_tensors=2, param_bytes=int(4 * _P),
                    expert_params=0, attention_bytes=0.0, dispatch_bytes=0.0, work_bytes=3e6)
    prof = ModelProfile(name="toy", units=[Unit("blocks.0", kind, None), Unit("blocks.1", kind, None)], batch0=2,
                        seq_len=16)
    return prof, dev


def test_expert_weights_are_moved_once_and_split_over_ep(toy):
    """A node's expert-weight bytes (``Program.expert_bytes``) are moved once per program, not
    per sample, and a rank of an ep group moves 1/ep of them (hand-derived on the toy device:
    1e12 FLOP/s, 1e11 B/s, 10 us a node)."""
    _, dev = toy
    prog = Program(flops=(1e6,), bytes_moved=(3e6,), dtypes=("float32",), views=(False,), expert_bytes=(2e6,))
    # ep=1, scale 1: 10 us + max(1 us, 3e6 / 1e11 = 30 us)
    assert prog.time(dev, 1.0) == pytest.approx(4.0e-5, rel=1e-12)
    # ep=4, scale 2: the 1 MB of rows twice, the 2 MB of weights a quarter: 10 us + max(2 us, 25 us)
    assert prog.time(dev, 2.0, 4) == pytest.approx(3.5e-5, rel=1e-12)
    # scale 100, ep=4: 10 us + max(100 us, (1e8 + 5e5) / 1e11 = 1005 us)
    assert prog.time(dev, 100.0, 4) == pytest.approx(1e-5 + 1.005e-3, rel=1e-12)


def _hand_pp1():
    """pp=1 dp=1, 1f1b, m=2 microbatches of 2: one stage holding both units, n = 2M parameters."""
    n = 2 * _P
    f = 2 * _F                                 # 2.02 ms
    # stage 0 receives no activation: its I is empty and W does the whole backward (I + W of both
    # units), plus the accumulation into .grad: 4 tensors x 10 us + read 2, write 1 of 8 MB at 100 GB/s
    b = 2 * (_I + _W) + 4 * _OV + 3 * 4 * n / _BW       # 10.04 + 0.04 + 0.24 = 10.32 ms
    makespan = 2 * (f + b)                     # F B F B on one rank: 24.68 ms
    # Adam over 2M fp32 parameters: 80 bytes per element + 12 node overheads per tensor
    opt = n * 80 / _BW + 12 * 4 * _OV          # 1.6 + 0.48 = 2.08 ms
    mem = {"weights": 4 * n, "gradients": 4 * n, "optimizer": 8 * n,      # fp32 weights, grads, Adam m + v
           "activations": 2 * 8e6,             # one microbatch in flight, both units' saved values
           "working": 3e6, "runtime": _RUNTIME}  # total 51 MB + 2 GiB
    return Layout(1, 1, 1, 1, "1f1b", 1, 2, 2, 0), (0, 2), makespan, 0.0, opt, [mem]


def _pp2_stage_times():
    # stage 0 (one unit): F 1.01 ms, backward all in W: I + W + 2 x 10 us + 3 x 4 MB / 100 GB/s = 5.16 ms
    # stage 1 (one unit): F 1.01 ms, I 2.01 ms, W 3.01 + 0.14 = 3.15 ms
    acc = 2 * _OV + 3 * 4 * _P / _BW
    return _F, _I + _W + acc, _I, _W + acc


def _pp2_memory(act0, act1):
    # per rank: one unit's 1M parameters; p2p: the sent tensors of its boundary (1 MB each) held
    # until a later message proves them received, at most min(m, in flight + 1) = 2 at m = 2,
    # plus two receive buffers
    return [{"weights": 4 * _P, "gradients": 4 * _P, "optimizer": 8 * _P, "activations": act, "working": 3e6,
             "p2p buffers": 2 * 1e6 + 2 * 1e6, "runtime": _RUNTIME} for act in (act0, act1)]


def _after_pp2():
    # after the pipeline: the loss broadcast over pp (one alpha), then Adam over 1M parameters in 2
    # tensors: 0.8 + 0.24 = 1.04 ms; rank 0 finishes last in both pp=2 cases below
    return _ALPHA, _P * 80 / _BW + 12 * 2 * _OV


def _hand_pp2_1f1b():
    """pp=2, 1f1b, m=2: rank 0 runs F0 F1 B0 B1, rank 1 F0 B0 F1 B1. With f and b equal on both
    stages (1.01 and 5.16 ms) and d = 100 us + 1 MB / 10 GB/s = 0.2 ms per message:
    rank 1: F(0) [f+d, 2f+d], B(0) until 2f+d+b, F(1) until 3f+d+b, B(1) until 3f+d+2b;
    rank 0: B(0) waits for B(0)'s gradient, [2f+2d+b, 2f+2d+2b], B(1) for the last one,
    [3f+2d+2b, 3f+2d+3b]: makespan 3f + 3b + 2d = 18.91 ms."""
    f, b0, i1, w1 = _pp2_stage_times()
    b = b0
    assert math.isclose(i1 + w1, b)
    d = _ALPHA + 1e6 / _LINK_BW
    makespan = 3 * f + 3 * b + 2 * d
    exposed, opt = _after_pp2()
    # activations: rank 0 holds two microbatches after F0 F1 (8 MB each), rank 1 one
    return (Layout(2, 1, 1, 1, "1f1b", 1, 2, 2, 0), (0, 1, 2), makespan, exposed, opt, _pp2_memory(16e6, 8e6))


def _hand_pp2_zbh1():
    """pp=2, zb-h1, m=2: rank 0 runs F0 F1 I0 W0 I1 W1, rank 1 F0 I0 F1 I1 W0 W1.
    rank 1: F(0) [f+d, 2f+d], I(0) until 2f+d+i1, F(1) until 3f+d+i1, I(1) until 3f+d+2i1, then
    both W: 3f+d+2i1+2w1 = 13.55 ms; rank 0: I(0) (empty) once I(0)'s gradient arrives at
    2f+2d+i1, W(0) until 2f+2d+i1+w0; I(1)'s gradient is there at 3f+2d+2i1, earlier (w0 = 5.16 >
    f + i1), so W(1) ends at 2f + 2d + i1 + 2w0 = 14.75 ms."""
    f, w0, i1, w1 = _pp2_stage_times()
    d = _ALPHA + 1e6 / _LINK_BW
    assert w0 > f + i1
    makespan = 2 * f + 2 * d + i1 + 2 * w0
    exposed, opt = _after_pp2()
    # activations (MB), F +8, I: 8 -> 10, W -10: rank 0: 8, 16, 18, 8, 10, 0; rank 1: 8, 10, 18, 20, 10, 0
    return (Layout(2, 1, 1, 1, "zb-h1", 1, 2, 2, 0), (0, 1, 2), makespan, exposed, opt, _pp2_memory(18e6, 20e6))


def _hand_dp2_zero1():
    """pp=1 dp=2, ZeRO-1, m=2: the pipeline of _hand_pp1 (24.68 ms), then inside the optimizer
    step: flatten the 2M gradients (read 2 + write 1 x 8 MB, 2 x 4 tensors x 10 us), reduce-scatter
    and all-gather 8 MB over 2 ranks (each 100 us + 4 MB / 10 GB/s = 0.5 ms), copy back (2 x 8 MB,
    4 x 10 us), the loss sum over dp (one alpha): 1.62 ms exposed; Adam steps one flat shard of 1M:
    0.8 ms + 12 x 10 us = 0.92 ms."""
    lay, bounds, makespan, _, _, (mem,) = _hand_pp1()
    n = 2 * _P
    rs = ag = _ALPHA + 0.5 * 4 * n / _LINK_BW
    exposed = 3 * 4 * n / _BW + 2 * 4 * _OV + rs + ag + 2 * 4 * n / _BW + 4 * _OV + _ALPHA
    opt = (n / 2) * 80 / _BW + 12 * _OV
    mem = dict(mem)
    mem["optimizer"] = (8 + 4) * n / 2     # Adam m + v and the fp32 master, of this rank's half
    # flat fp32 gradients + their shard + the gathered parameters: 4 x (2n + n/2) = 20 MB, allocated
    # once the activations (16 MB) and working set (3 MB) are gone: 1 MB more than the pipeline's peak
    mem["zero-1 buffers"] = 4 * (2 * n + n / 2) - (16e6 + 3e6)
    return Layout(1, 2, 1, 1, "1f1b", 1, 2, 2, 1), bounds, makespan, exposed, opt, [mem]


@pytest.mark.parametrize("case", [_hand_pp1, _hand_pp2_1f1b, _hand_pp2_zbh1, _hand_dp2_zero1],
                         ids=["pp1", "pp2-1f1b", "pp2-zb-h1", "dp2-zero1"])
def test_step_time_and_memory_by_hand(toy, case):
    prof, dev = toy
    lay, bounds, makespan, exposed, opt, mem = case()
    ev = Evaluator(prof, dev, memory_limit=10**12, global_batch=lay.dp * lay.m * lay.b)
    est = ev.evaluate(lay, Partition(bounds, (False,) * (len(bounds) - 1)))
    assert math.isclose(est.makespan_s, makespan, rel_tol=1e-9), (est.makespan_s, makespan)
    assert math.isclose(est.dp_exposed_s, exposed, rel_tol=1e-9, abs_tol=1e-12), (est.dp_exposed_s, exposed)
    assert math.isclose(est.optimizer_s, opt, rel_tol=1e-9), (est.optimizer_s, opt)
    assert math.isclose(est.step_time, makespan + exposed + opt, rel_tol=1e-9)
    assert len(est.memory) == len(mem)
    for r, want in enumerate(mem):
        got = {k: v for k, v in est.memory[r].items() if v}
        assert set(got) == set(want), (r, got, want)
        for k, v in want.items():
            assert math.isclose(got[k], v, rel_tol=1e-9), (r, k, got[k], v)
        assert math.isclose(est.peak_memory[r], sum(want.values()), rel_tol=1e-12)


def test_hand_made_ordering(toy):
    """zb-h1 beats 1f1b on the same two stages (14.75 + 1.14 vs 18.91 + 1.14 ms by hand above),
    and recomputing a stage costs time and saves activations: its I replays the forward."""
    prof, dev = toy
    ev = Evaluator(prof, dev, memory_limit=10**12, global_batch=4)
    plain, rc = Partition((0, 1, 2), (False, False)), Partition((0, 1, 2), (False, True))
    zb = ev.evaluate(Layout(2, 1, 1, 1, "zb-h1", 1, 2, 2, 0), plain)
    one = ev.evaluate(Layout(2, 1, 1, 1, "1f1b", 1, 2, 2, 0), plain)
    assert zb.step_time < one.step_time
    one_rc = ev.evaluate(Layout(2, 1, 1, 1, "1f1b", 1, 2, 2, 0), rc)
    # stage 1 recomputing: its B grows by one F (1.01 ms). Redoing the 1f1b timeline with b1 = b + f
    # on rank 1: makespan 3f + 2d + 2b1 + b0, i.e. +2 x 1.01 ms (both of rank 1's B are on the path)
    assert math.isclose(one_rc.makespan_s - one.makespan_s, 2 * _F, rel_tol=1e-9)
    # rank 1 keeps its input (1 MB) instead of the 8 MB F saved, but its I replays the forward
    # first: the 8 MB are live again while its backward runs, on top of the kept input. The last
    # stage of 1f1b holds one microbatch at a time, so recomputing there costs 1 MB, saves nothing
    assert math.isclose(one_rc.peak_memory[1] - one.peak_memory[1], 1e6, rel_tol=1e-9)
    assert one_rc.memory[1]["activations"] == 1e6 and one_rc.memory[1]["working"] == 3e6 + 8e6


# ---------------------------------------------------------------------------------------------
# P2: properties of the chosen plan

# the GPT fixture's tied embedding / head: one [vocab, d_model] weight in the prologue and the epilogue
_GPT_TIED = 256 * 32


def _check_plan(res, prof, req, tied: int = 0):
    c = res.chosen
    assert c is not None
    lay, est = c.layout, c.estimate
    assert lay.pp * lay.dp * lay.cp * lay.tp == req.gpus
    assert (lay.dp * lay.cp) % lay.ep == 0
    assert req.global_batch == lay.dp * lay.m * lay.b
    for r in range(lay.pp):
        assert est.peak_memory[r] <= req.memory_limit
    # stage boundaries cover every unit once, in order
    b = est.partition.bounds
    S = lay.pp * lay.v
    assert b[0] == 0 and b[-1] == len(prof.units) and all(x < y for x, y in zip(b, b[1:]))
    assert len(b) - 1 == S
    s2r = est.stage_to_rank
    # weights over the pp ranks (whole below ZeRO-3) = the model's parameters, experts split by ep,
    # and the tied weight twice when its two units (first and last) sit on different ranks
    if lay.zero < 3:
        held = sum(row["weights"] for row in est.memory) / res.evaluator.precision.weight
        units = res.evaluator.for_tp(lay.tp).units  # (a tp rank's: its shards; the tied weight stays whole)
        expect = sum(u.kind.params - u.kind.expert_params * (1 - 1 / lay.ep) for u in units) - tied
        expect += tied if s2r[0] != s2r[S - 1] else 0
        assert math.isclose(held, expect, rel_tol=1e-9), (held, expect)
    # the simulated makespan against bounds from first principles, given the stage costs: every rank
    # does m x (F + I + W) of each of its stages, one microbatch goes through every F and every I
    # (then stage 0's W), crossing each rank boundary twice; and at any moment some rank computes
    # or some message travels (otherwise the schedule is stuck), so the makespan is at most all the
    # work plus every message in sequence
    costs = est.stage_costs
    alpha, bw = est.p2p_link
    delay = [alpha + x / bw for x in est.message_bytes]
    cross = [j for j in range(S - 1) if s2r[j] != s2r[j + 1]]
    work = [sum(costs.f[s] + costs.i[s] + costs.w[s] for s in range(S) if s2r[s] == r) for r in range(lay.pp)]
    lower = max(lay.m * max(work), sum(costs.f) + sum(costs.i) + costs.w[0] + 2 * sum(delay[j] for j in cross))
    upper = lay.m * sum(work) + 2 * lay.m * sum(delay[j] for j in cross)
    assert lower * (1 - 1e-9) <= est.makespan_s <= upper * (1 + 1e-9), (lower, est.makespan_s, upper)


def _every_layout(prof, req):
    """Every (pp, dp, cp, schedule, m, ZeRO) the request allows, enumerated here from the rules
    (pp*dp*cp = gpus, dp*m*b = batch, cp divides the heads and the sequence, S = pp*v stages of
    at least one unit, the schedule's own constraints; v the schedule's default, and 2, 4 or 8
    for interleaved-1f1b below 2*pp microbatches); the model has no experts."""
    for pp in range(1, req.gpus + 1):
        for cp in range(1, req.gpus // pp + 1):
            if req.gpus % (pp * cp) or (cp > 1 and (prof.n_heads % cp or prof.seq_len % cp)):
                continue
            dp = req.gpus // (pp * cp)
            if req.global_batch % dp:
                continue
            per = req.global_batch // dp
            for m in (x for x in range(1, per + 1) if per % x == 0):
                for name in (("1f1b",) if pp == 1 else registry.names()):
                    vs = (1,) if pp == 1 else (2, 4, 8) if name == "interleaved-1f1b" and m < 2 * pp else (
                        registry.default_stages_per_rank(name),)
                    for v in vs:
                        if pp * v > len(prof.units) or (name == "zb-auto" and pp * m > req.zb_auto_max):
                            continue
                        try:
                            registry.check(name, pp, m, v)
                        except ValueError:
                            continue
                        for z in (0, 1, 2, 3) if dp * cp > 1 else (0,):
                            yield Layout(pp, dp, cp, 1, name, v, m, per // m, z)


def _priced_by_enumeration(prof, device, req):
    """{layout: step time} of every layout that fits with balanced stages, plain or (if plain does
    not fit) every stage recomputing: what the exhaustive search must at least find, priced by a
    fresh Evaluator, without the search's screen."""
    ev = Evaluator(prof, device, req.memory_limit, req.global_batch)
    out = {}
    for lay in _every_layout(prof, req):
        S = lay.num_stages
        bounds = balanced_partition([sum(ev.unit_times(u.kind, lay)) for u in prof.units], S)
        for rc in (False, True):
            est = ev.evaluate(lay, Partition(bounds, (rc,) * S))
            if est.feasible:
                out[lay] = est.step_time
                break
    return out


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(gpus=st.sampled_from([1, 2, 4]), batch=st.sampled_from([8, 16]),
       over_mib=st.sampled_from([0.5, 1.0, 1.5, 4.0]), device=st.sampled_from(["h100", "a100-80gb"]))
def test_chosen_plan_properties(gpt_profile, gpus, batch, over_mib, device):
    # the limit is the GPU profiles' 2 GiB runtime overhead plus what the tiny model needs: from
    # none fits (1 GPU, +0.5 MiB) through binding (the fastest layouts OOM) to loose
    _check_search(gpt_profile, device, Request(gpus=gpus, global_batch=batch, memory_limit=2 * GiB + over_mib * 2**20,
                                               exhaustive=True))


def _check_search(prof, device, req):
    res = plan(prof, get_profile(device), req)
    fits = _priced_by_enumeration(prof, get_profile(device), req)
    by_layout = {c.layout: c for c in res.candidates}
    # every layout that fits with balanced stages is found feasible by the search (its screen
    # rejected none of them), at that time or better (the ILP's boundaries)
    for lay, t in fits.items():
        c = by_layout.get(lay)
        assert c is not None and c.status in ("chosen", "feasible"), (lay.label(), c and (c.status, c.reason))
        assert c.time <= t * (1 + 1e-9), lay.label()
    if res.chosen is None:
        assert not fits and not res.feasible()
        return
    assert res.chosen.time <= min(fits.values(), default=math.inf) * (1 + 1e-9)
    _check_plan(res, prof, req, tied=_GPT_TIED)
    again = plan(prof, get_profile(device), req)
    assert (again.chosen.layout, again.chosen.estimate.partition) == (res.chosen.layout, res.chosen.estimate.partition)


def test_screen_rejects_no_layout_that_fits(gpt_profile):
    req = Request(gpus=1, global_batch=8, memory_limit=2 * GiB + 1.1 * 2**20, exhaustive=True)
    if not _priced_by_enumeration(gpt_profile, get_profile("h100"), req):
        raise RuntimeError("no layout fits at this limit any more: pick a limit where one fits just")
    _check_search(gpt_profile, "h100", req)


def test_moe_plan_properties_and_ep(mixtral_profile):
    req = Request(gpus=64, global_batch=64, memory_limit=80e9)
    res = plan(mixtral_profile, get_profile("h100"), req)
    _check_plan(res, mixtral_profile, req)
    assert any(c.layout.ep > 1 for c in res.candidates if c.estimate is not None), "EP layouts are priced"


def test_the_answer_does_not_depend_on_the_machine_speed(mixtral_profile, monkeypatch):
    """Every search budget counts work: a machine whose clock runs 1000 s per reading (as if
    every step of the search took that long) gets the same chosen plan, candidates, statuses,
    predictions and stage boundaries as a real one."""
    req = Request(gpus=64, global_batch=64, memory_limit=80e9)
    fast = plan(mixtral_profile, get_profile("h100"), req)
    from autopar.planner import ilp, search

    clock = [0.0]

    def slow():
        clock[0] += 1000.0
        return clock[0]

    monkeypatch.setattr(search.time, "perf_counter", slow)
    monkeypatch.setattr(ilp.time, "perf_counter", slow)
    slow_res = plan(mixtral_profile, get_profile("h100"), req)

    def summary(res):
        return [(c.layout, c.status, c.reason if c.status != "chosen" else "", c.time,
                 c.estimate.partition if c.estimate is not None else None) for c in res.candidates]

    assert slow_res.chosen.layout == fast.chosen.layout and slow_res.chosen.time == fast.chosen.time
    assert summary(slow_res) == summary(fast)
    assert [r.status for r in slow_res.ilp_runs] == [r.status for r in fast.ilp_runs]


_WALL = ("capture_s", "trace_s", "search_s", "solver_s")  # the report's measured phase times


def _without_wall(obj):
    if isinstance(obj, dict):
        return {k: _without_wall(v) for k, v in obj.items() if k not in _WALL}
    if isinstance(obj, list):
        return [_without_wall(v) for v in obj]
    return obj


def test_plan_model_json_is_the_same_on_a_slower_machine(monkeypatch):
    """P1: plan_model on a captured model (h100 profile: costs from the device model, not from
    timing this machine), then again with perf_counter and monotonic running 10x slower: the
    plan JSON is identical but for the measured phase times."""
    import json
    import time as time_mod

    from autopar.examples.gpt import make_gpt
    from autopar.planner import plan_model
    from autopar.planner.report import to_json

    def once():
        model, inputs, target, loss = make_gpt(n_layer=4, d_model=32, n_head=2, seq_len=16, batch_size=2)
        res, info = plan_model(model, inputs, target, loss, gpus=8, global_batch=64, device=get_profile("h100"),
                               memory_limit=2 * GiB + 2**24)
        return json.loads(json.dumps(to_json(res, info, top=10)))

    first = once()
    real_pc, real_mono = time_mod.perf_counter, time_mod.monotonic
    start_pc, start_mono = real_pc(), real_mono()
    monkeypatch.setattr(time_mod, "perf_counter", lambda: start_pc + 10 * (real_pc() - start_pc))
    monkeypatch.setattr(time_mod, "monotonic", lambda: start_mono + 10 * (real_mono() - start_mono))
    second = once()
    assert first["search_s"] > 0 and second["search_s"] > 0
    assert _without_wall(second) == _without_wall(first)


def _formula_vs_estimate(prof, limit, sizes):
    """memory_formula(b, s) of the chosen plan at other microbatch sizes vs the estimate of the
    same layout and stage boundaries at those sizes."""
    res = plan(prof, get_profile("h100"), Request(gpus=2, global_batch=8, memory_limit=limit))
    est = res.chosen.estimate
    b, s = sympy.symbols("b s", positive=True)
    out = []
    for size in sizes(est.layout.b):
        other = res.evaluator.evaluate(dataclasses.replace(est.layout, b=size), est.partition)
        for r in range(len(est.memory)):
            val = float(memory_formula(res, est, r).subs({b: size, s: prof.seq_len}))
            out.append((size, r, val, other.peak_memory[r]))
    return out


def test_memory_formula_predicts_larger_microbatches(gpt_profile):
    for size, r, val, want in _formula_vs_estimate(gpt_profile, 8e9, lambda b: (2 * b, 4 * b, 16 * b)):
        assert math.isclose(val, want, rel_tol=1e-6), (size, r, val, want)


def test_memory_formula_predicts_smaller_microbatches(gpt_profile):
    res = plan(gpt_profile, get_profile("h100"), Request(gpus=2, global_batch=8, memory_limit=8e9))
    small = res.evaluator.evaluate(dataclasses.replace(res.chosen.layout, b=1), res.chosen.estimate.partition)
    if not any(row["dp buckets"] + row["zero-1 buffers"] for row in small.memory):
        raise RuntimeError("the plan at b=1 has no reduction-buffer excess: this case no longer shows the bug")
    for size, r, val, want in _formula_vs_estimate(gpt_profile, 8e9, lambda b: (1,)):
        assert math.isclose(val, want, rel_tol=1e-6), (size, r, val, want)


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
                held = [u.kind for s in stages for u in ev.units[bounds[s]:bounds[s + 1]]]
                static = sum(ilp_unit_static(ev, k, lay) for k in held)
                fixed = sum(_fixed_memory(ev, lay, max(k.work_bytes for k in held) * sc,
                                          max(max(k.out_bytes, k.in_bytes) for k in held) * sc).values())
                for v in vecs[r]:
                    if static + sum(c * act[s] for s, c in v.items()) + fixed > limit * (1 + 1e-9):
                        ok = False
            if ok:
                best = min(best, max(load))
    return best


# limits: the GPU profile's 2 GiB runtime overhead plus a few hundred KiB, from no cut fitting
# (gpipe, +0.6 MiB) through cuts that must recompute some or all stages to loose (+64 MiB)
@pytest.mark.parametrize("schedule,pp,m,over_mib", [("1f1b", 2, 4, 64), ("1f1b", 2, 4, 0.8), ("zbv", 2, 4, 1.0),
                                                    ("1f1b", 3, 3, 0.8), ("gpipe", 2, 8, 1.5), ("gpipe", 2, 8, 0.6)])
def test_ilp_matches_brute_force(gpt_profile, schedule, pp, m, over_mib):
    ev = Evaluator(gpt_profile, get_profile("h100"), 2 * GiB + over_mib * 2**20, global_batch=m * 2)
    v = registry.default_stages_per_rank(schedule)
    lay = Layout(pp, 1, 1, 1, schedule, v, m, 2, 0)
    sched = build(schedule, pp, m, v)
    frac = 0.5
    res = solve_partition(ev, lay, sched, frac, max_nodes=100_000)
    expected = _brute_force(ev, lay, sched, frac, ev.memory_limit)
    if expected == math.inf:
        assert res.partition is None and res.status == "infeasible"
        return
    assert res.status == "optimal"
    assert math.isclose(res.objective, expected, rel_tol=1e-5)
    assert 0.0 <= res.gap <= 1.0
    # the ILP's memory accounting is conservative: its cut fits under the estimate's own walk too
    assert max(ev.peak_memory_only(lay, res.partition)) <= ev.memory_limit


def test_balanced_partition_is_optimal():
    for times, S in [([3, 1, 1, 1, 3], 3), ([1, 2, 3, 4, 5, 6], 3), ([5, 1, 1, 1, 1, 1, 1, 5], 4), ([1] * 7, 7)]:
        got = balanced_partition([float(t) for t in times], S)
        cost = max(sum(times[got[i]:got[i + 1]]) for i in range(S))
        best = min(max(sum(times[b[i]:b[i + 1]]) for i in range(S))
                   for cuts in itertools.combinations(range(1, len(times)), S - 1) for b in [(0, *cuts, len(times))])
        assert cost == best and len(got) == S + 1


def test_price_matches_search(gpt_profile):
    """``price`` (what the benchmarks compare with a measurement) gives a layout the boundaries,
    recompute and time the exhaustive search gives it when every simulated layout gets the ILP."""
    limit = 2 * GiB + 2**20
    lay = Layout(2, 1, 1, 1, "1f1b", 1, 4, 2, 0)
    c = price(Evaluator(gpt_profile, get_profile("h100"), limit, 8), lay)
    req = Request(gpus=2, global_batch=8, memory_limit=limit, schedules=("1f1b",), zero_levels=(0,), allow_cp=False,
                  exhaustive=True, top_ilp=10**6)
    res = plan(gpt_profile, get_profile("h100"), req)
    (s,) = [x for x in res.candidates if x.layout == lay]
    assert c.estimate is not None and s.estimate is not None and c.estimate.feasible
    assert c.estimate.partition == s.estimate.partition
    assert math.isclose(c.estimate.step_time, s.estimate.step_time, rel_tol=1e-12)


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
    # the defaults and the model reach the search: the profile's memory, the factory's parameters
    # (the tied embedding / head once), and the plan fits
    from autopar.examples.gpt import make_gpt

    assert data["memory_limit_bytes"] == get_profile("h100").memory_bytes
    assert data["parameters"] == sum(p.numel() for p in make_gpt()[0].parameters())
    assert max(data["peak_memory_bytes"]) <= data["memory_limit_bytes"]
    # the chosen plan is listed among the candidates, once, with the same layout and time
    (me,) = [c for c in data["candidates"] if c["status"] == "chosen"]
    assert all(me[k] == data[k] for k in ("pp", "dp", "cp", "ep", "schedule", "num_microbatches", "zero"))
    assert me["predicted_step_time_s"] == data["predicted_step_time_s"]
    assert len(data["stage_cuts"]) == data["pp"] * data["stages_per_rank"] - 1


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
    # (tensor parallelism with sequence parallelism cuts a layer's activations too: off here)
    rc, data = _plan_json(capsys, args + ["--no-cp", "--no-tp"])
    assert rc == 2 and not data["feasible"] and data["min_memory_needed_bytes"] > data["memory_limit_bytes"]
    rc, data = _plan_json(capsys, args + ["--no-tp"])
    assert rc == 0 and data["cp"] > 1
    assert max(data["peak_memory_bytes"]) <= data["memory_limit_bytes"]


def test_deepseek_needs_ep(capsys):
    args = ["deepseek-v3", "--gpus", "256", "--global-batch", "256", "--seq", "1024", "--schedules", "1f1b,zb-h1"]
    rc, data = _plan_json(capsys, args + ["--no-ep"])
    assert rc == 2 and not data["feasible"]
    rc, data = _plan_json(capsys, args)
    assert rc == 0 and data["ep"] > 1 and (data["dp"] * data["cp"]) % data["ep"] == 0


# pinned layout fields (autopar plan --pin, Request(pin=...), plan_model(pin=...))
def test_pin_restricts_search_to_the_fastest_matching_layout(gpt_profile):
    dev = get_profile("h100")
    # reference: the exhaustive unpinned search, filtered by hand to pp=2, zero=1
    kw = dict(gpus=4, global_batch=4, memory_limit=80e9, exhaustive=True, schedules=("1f1b", "zb-h1"))
    full = plan(gpt_profile, dev, Request(**kw))
    ref = [c for c in full.feasible() if c.layout.pp == 2 and c.layout.zero == 1]
    pinned = plan(gpt_profile, dev, Request(**kw, pin={"pp": 2, "zero": 1}))
    seen = [c for c in pinned.candidates if c.status != "rejected"]
    assert seen and all(c.layout.pp == 2 and c.layout.zero == 1 for c in seen)
    assert pinned.chosen.layout == ref[0].layout
    assert pinned.chosen.time == pytest.approx(ref[0].time, rel=1e-12)


def test_parse_pin_and_bad_pins():
    from autopar.planner.cli import main as cli_main
    from autopar.planner.request import parse_pin

    assert parse_pin("pp=16, ep=64,dp=128,zero=1,microbatches=8,schedule=zb-h2") == \
        {"pp": 16, "ep": 64, "dp": 128, "zero": 1, "m": 8, "schedule": "zb-h2"}
    with pytest.raises(ValueError, match=r"pp\*dp\*cp = 12 is not the GPU count 8"):
        Request(gpus=8, global_batch=8, memory_limit=1e9, pin={"pp": 2, "dp": 3, "cp": 2})
    with pytest.raises(ValueError, match="pp=3 does not divide the GPU count 8"):
        Request(gpus=8, global_batch=8, memory_limit=1e9, pin={"pp": 3})
    with pytest.raises(ValueError, match="unknown field"):
        parse_pin("sp=2")
    with pytest.raises(ValueError, match=r"pp\*dp\*cp\*tp = 16 is not the GPU count 8"):
        Request(gpus=8, global_batch=8, memory_limit=1e9, pin={"pp": 2, "dp": 2, "cp": 2, "tp": 2})
    with pytest.raises(ValueError, match="expected an integer"):
        parse_pin("pp=two")
    with pytest.raises(ValueError, match="unknown schedule"):
        parse_pin("schedule=nope")
    assert cli_main(["llama3-8b", "--gpus", "8", "--global-batch", "8", "--pin", "sp=2", "--quiet"]) == 2
    # NVIDIA's DeepSeek-V3 recipe: ep=64 over tp=2 x dp=32, experts folded over tp, is expressible;
    # a layout the runtime cannot express is refused by the constraint it breaks, not priced as
    # "no plan fits"
    Request(gpus=1024, global_batch=8192, memory_limit=80e9, pin={"tp": 2, "pp": 16, "ep": 64, "dp": 32})
    with pytest.raises(ValueError, match=r"ep=128: experts are sharded over the dp x cp x tp = 32 x 1 x 2 = 64 ranks"):
        Request(gpus=1024, global_batch=8192, memory_limit=80e9, pin={"tp": 2, "pp": 16, "ep": 128, "dp": 32})
    with pytest.raises(ValueError, match=r"ep=8: .* dp x cp = 2 x 2 = 4 ranks"):
        Request(gpus=8, global_batch=8, memory_limit=1e9, pin={"dp": 2, "cp": 2, "ep": 8})


# ------------------------------------------------------------ activation peaks without schedules
@pytest.mark.parametrize("name", [n for n in registry.names() if n != "zb-auto"])
def test_frontier_peaks_equal_walking_the_built_schedule(name):
    """inflight_frontier (steady m capped, no build past warm-up) gives exactly the peaks
    schedules.simulate.peak_memory walks on registry.build's schedule, for random amounts."""
    import random

    from autopar.planner.estimate import frontier_peaks, inflight_frontier
    from autopar.schedules.simulate import peak_memory

    rng = random.Random(0)
    v0 = registry.default_stages_per_rank(name)
    for pp in (2, 3, 4):
        for v in ((v0, 3) if name in ("interleaved-1f1b", "zb-h1") and v0 != 1 else (v0,)) + \
                ((2,) if name == "zb-h1" else ()):
            for m in range(1, 4 * pp + 3):
                try:
                    registry.check(name, pp, m, v)
                except ValueError:
                    continue
                sched = build(name, pp, m, v)
                S = pp * v
                for _ in range(3):
                    af = [rng.uniform(0, 10) for _ in range(S)]
                    ai = [rng.uniform(0, 12) for _ in range(S)]
                    want = peak_memory(sched, af, after_i_bytes=ai)
                    got = frontier_peaks(inflight_frontier(name, pp, m, v), af, ai)
                    assert got == pytest.approx(want, rel=1e-12), (name, pp, m, v)


# ------------------------------------------------------------------- the memory screen is a bound
def _screen_bound_holds(prof, req):
    res = plan(prof, get_profile("h100"), req)
    priced = [c for c in res.candidates if c.peak is not None]
    assert priced
    for c in priced:
        assert c.screen_need <= c.peak * (1 + 1e-9), (c.layout.label(), c.screen_need, c.peak)
    return res


def test_screen_never_above_evaluated_memory(gpt_profile, mixtral_profile):
    # every layout the exhaustive search evaluates: the screen's lower bound <= its priced peak
    _screen_bound_holds(gpt_profile, Request(gpus=4, global_batch=8, memory_limit=80e9, exhaustive=True))
    res = _screen_bound_holds(mixtral_profile, Request(gpus=16, global_batch=16, memory_limit=200e9, exhaustive=True,
                                                       schedules=("1f1b", "zbv", "interleaved-1f1b", "v-half")))
    assert any(c.layout.ep > 1 and c.layout.zero >= 1 for c in res.candidates if c.estimate is not None)
    # and it screens out: a limit below every layout's bound rejects them all, with the reason
    tight = plan(mixtral_profile, get_profile("h100"), Request(gpus=16, global_batch=16, memory_limit=30e9))
    assert any("lower bound" in c.reason for c in tight.candidates if c.status == "rejected")


# -------------------------------------------------------------------------- experts under ZeRO
def test_experts_sharded_over_the_expert_data_parallel_group(mixtral_profile):
    """Experts' optimizer state (ZeRO >= 1), gradients (>= 2) and weights (3) are sharded over the
    dp*cp/ep ranks holding the same experts, dense parameters over dp*cp (hand formulas)."""
    ev = Evaluator(mixtral_profile, get_profile("h100"), 80e9, 64)
    moe = next(k for k in mixtral_profile.kinds if k.expert_params)
    p = ev.precision
    n, small = moe.params - moe.expert_params, moe.small_params

    def part(z, g, elems, small=0):
        if z == 0 or g == 1:
            return (p.weight + p.grad + p.optim) * elems
        if z == 1:
            return (p.weight + p.grad) * elems + p.optim * elems / g
        if z == 2:
            return p.weight * elems + 4 * (1 + 1 / g) * elems + (p.adam + 4) * elems / g
        return 4 * elems / g + p.weight * small + 4 * (1 + 1 / g) * elems + p.adam * elems / g

    for dp, ep, zero in [(8, 8, 1), (8, 2, 1), (8, 2, 0), (8, 1, 2), (8, 4, 3), (8, 2, 2)]:
        lay = Layout(2, dp, 1, ep, "1f1b", 1, 4, 2, zero)
        want = part(zero, dp, n, small) + part(zero, dp // ep, moe.expert_params / ep)
        assert ev.unit_static(moe, lay) == pytest.approx(want, rel=1e-12), (dp, ep, zero)
    # ep == dp*cp: a group of one, the experts stay whole; smaller ep shards them
    whole = ev.unit_static(moe, Layout(2, 8, 1, 8, "1f1b", 1, 4, 2, 1))
    assert ev.unit_static(moe, Layout(2, 8, 1, 8, "1f1b", 1, 4, 2, 0)) - whole == pytest.approx(
        p.optim * n * (1 - 1 / 8), rel=1e-12)


# ------------------------------------------------------------- token-proportional MoE dispatch
def test_routed_dispatch_prices_rows_and_imbalance():
    from autopar.planner.comm import all_to_all_time

    pm = presets.build_preset("deepseek-v3", seq_len=128)
    prof = profile_model(pm.model, pm.inputs, pm.target, pm.loss_fn, name=pm.name, layer_repeats=pm.layer_repeats,
                         expert_prefixes=pm.expert_param_prefixes, n_heads=pm.n_heads, n_experts=pm.n_experts,
                         seq_len=128, moe=pm.moe)
    moe = next(k for k in prof.kinds if k.expert_params)
    r = moe.routed
    assert r.rows == 128 * 8 and r.row_bytes == 7168 * 2 and r.flops_per_row == 6 * 7168 * 2048
    assert (4 * 7168 + 4 * 2048) * 2 <= r.saved_row_bytes <= (5 * 7168 + 4 * 2048 + 3) * 2
    dev = get_profile("h100")
    lay = Layout(4, 16, 1, 8, "1f1b", 1, 8, 1, 1)
    flat, skew = Evaluator(prof, dev, 80e9, 128, moe_imbalance=1.0), Evaluator(prof, dev, 80e9, 128, moe_imbalance=2.0)
    f1, i1, w1 = flat.unit_times(moe, lay)
    f2, i2, w2 = skew.unit_times(moe, lay)
    link = flat.links(lay)["ep"]
    a2a = [2 * all_to_all_time(r.rows * x * r.row_bytes, 8, link) for x in (1.0, 2.0)]
    extra = r.rows * r.flops_per_row / dev.flops_rate("bfloat16")
    assert f2 - f1 == pytest.approx(a2a[1] - a2a[0] + extra, rel=1e-9)
    assert i2 - i1 == pytest.approx(a2a[1] - a2a[0] + extra, rel=1e-9)
    assert w2 - w1 == pytest.approx(extra, rel=1e-9)
    # memory: the worst rank keeps imbalance x the mean routed rows from F to W
    part = Partition(balanced_partition([sum(flat.unit_times(u.kind, lay)) for u in prof.units], 4), (False,) * 4)
    m1, m2 = flat.evaluate(lay, part), skew.evaluate(lay, part)
    assert max(row["moe receive"] for row in m2.memory) == pytest.approx(
        2 * max(row["moe receive"] for row in m1.memory), rel=1e-9)
    assert max(row["moe receive"] for row in m1.memory) > 0
    with pytest.raises(ValueError, match="must be >= 1"):
        Request(gpus=8, global_batch=8, memory_limit=80e9, moe_imbalance=0.5)


# ------------------------------------------------- a pinned layout never beats the unpinned choice
def test_unpinned_choice_no_slower_than_a_fitting_pin(mixtral_profile):
    dev = get_profile("h100")
    kw = dict(gpus=16, global_batch=32, memory_limit=80e9)
    free = plan(mixtral_profile, dev, Request(**kw))
    for pin in ({"pp": 2, "ep": 8, "zero": 1}, {"pp": 4, "ep": 4}, {"pp": 2, "ep": 2, "zero": 1}):
        pinned = plan(mixtral_profile, dev, Request(**kw, pin=pin))
        if pinned.chosen is not None:
            assert free.chosen.time <= pinned.chosen.time * (1 + 1e-12), (pin, free.chosen.layout.label())


def test_pin_report_when_the_pinned_layout_does_not_fit(gpt_profile):
    from autopar.planner.report import text

    res = plan(gpt_profile, get_profile("h100"), Request(gpus=4, global_batch=8, memory_limit=2 * GiB + 2 ** 10,
                                                         pin={"pp": 2, "zero": 0, "tp": 1}))
    assert res.chosen is None
    out = text(res, {})
    close = res.closest()
    assert "pinned layout" in out and "recomputation:" in out and "ZeRO-1 (pin zero=1)" in out
    assert "activation offload 1 (Plan(offload=1)): " in out
    assert f"{(close.peak - res.request.memory_limit) / GiB:.2f} GiB" in out


def test_pin_report_names_what_autopar_lacks(mixtral_profile):
    """Issue 34 P4: a pinned MoE layout that fits with none of autopar's memory features says what
    the ones it lacks would do, on the heaviest rank of the layout with every feature on
    (recomputing, offload 1): the MoE rows the dispatch holds from F to W (which offload does not
    move: the offloaded layout keeps all of them), and FP8 activation caching at half of the
    saved activations and rows, against what is over."""
    from autopar.planner.report import text

    res = plan(mixtral_profile, get_profile("h100"), Request(gpus=16, global_batch=32, memory_limit=8 * GiB,
                                                             pin={"pp": 2, "ep": 8, "zero": 1, "schedule": "1f1b"}))
    assert res.chosen is None
    out = text(res, {})
    ev, c = res.evaluator, res.closest()
    lay, S = c.layout, c.layout.num_stages
    bounds = c.estimate.partition.bounds if c.estimate is not None else \
        balanced_partition([sum(ev.unit_times(u.kind, lay)) for u in ev.units], S)
    on = ev.evaluate(dataclasses.replace(lay, offload=1.0), Partition(bounds, (True,) * S))
    off = ev.evaluate(lay, Partition(bounds, (True,) * S))
    r, over = on.oom()
    moe, act = on.memory[r]["moe receive"], on.memory[r]["activations"]
    assert moe > 0 and moe == pytest.approx(off.memory[r]["moe receive"], rel=1e-9)  # the rows stay put
    assert f"received rows ({moe / GiB:.2f} GiB on rank {r})" in out, out
    half = (act + moe) / 2
    assert f"would save about {half / GiB:.2f} GiB on rank {r}: " in out, out
    assert ("it would fit" in out) == (half >= over)


# ------------------------------------------- the search's shortcuts are bounds, not guesses
def test_zb_auto_floor_and_family_bound_never_above_evaluated_memory(mixtral_profile):
    """The schedule floor (one microbatch in flight per stage) is <= the memory of the order zb-auto's
    search returns, per rank; a family the screen drops whole has every layout's own screen
    bound over the limit too; to_plan's receive bound is the priced imbalance where ep > 1."""
    from autopar.planner.screen import _Screen
    from autopar.planner.search import _floor, plan_moe_imbalance

    ev = Evaluator(mixtral_profile, get_profile("h100"), 80e9, 32)
    for pp, v, m, zero in [(2, 1, 4, 1), (4, 1, 8, 2), (2, 2, 4, 0)]:
        lay = Layout(pp, 16 // pp, 1, 2, "zb-auto", v, m, 32 // (16 // pp) // m, zero)
        S = lay.num_stages
        bounds = balanced_partition([sum(ev.unit_times(u.kind, lay)) for u in mixtral_profile.units], S)
        for rc in (False, True):
            part = Partition(bounds, (rc,) * S)
            est = ev.evaluate(lay, part)
            floor = _floor(ev, lay, part)
            assert max(floor) <= max(est.peak_memory) * (1 + 1e-12), (lay.label(), rc)
    # the preset's MoE is dropless: ep > 1 carries the priced imbalance, ep = 1 none
    assert plan_moe_imbalance(ev, lay) == ev.moe_imbalance
    assert plan_moe_imbalance(ev, Layout(2, 8, 1, 1, "zb-auto", 1, 4, 1, 0)) is None
    tight = Evaluator(mixtral_profile, get_profile("h100"), 20e9, 32)
    screen = _Screen(tight)
    dropped = [(pp, 16 // pp, 1, ep, z) for pp in (1, 2, 4) for ep in (1, 2) for z in (0, 1)
               if not screen.family_ok(pp, 16 // pp, 1, ep, z)]
    assert dropped
    for pp, dp, cp, ep, z in dropped:
        c = screen(Layout(pp, dp, cp, ep, "1f1b", 1, 2 * pp, 32 // dp // (2 * pp) or 1, z))
        assert c.status == "rejected" and c.screen_need >= screen.family(pp, dp, cp, ep, z)[0]


def test_planner_chunks_the_loss_only_where_memory_binds(monkeypatch):
    """Issue 35 M4: at a limit no layout meets with the loss as captured (checked by pricing every
    layout, balanced stages, with and without recomputation), the search finds a plan by chunking
    the cross-entropy, and its Plan says so; with ``loss_chunking=False`` nothing fits; with room
    to spare the loss stays as captured (chunking only adds a recomputed head GEMM)."""
    from autopar import linear_ce
    from autopar.examples.gpt import make_gpt
    from autopar.planner.search import to_plan

    monkeypatch.setattr(linear_ce, "CHUNK_ELEMENTS", 2 ** 17)  # the smallest chunk, 128 tokens, at a 4096 vocabulary
    # 512 tokens a sample: even a one-sample microbatch is 4 chunks
    model, inputs, target, loss = make_gpt(n_layer=2, d_model=32, n_head=2, seq_len=512, batch_size=1,
                                           vocab_size=4096)
    prof = profile_model(model, inputs, target, loss, name="gpt-4k-vocab", n_heads=2)
    assert prof.chunked is not None and prof.chunked.loss_chunk_tokens == 128
    dev = get_profile("h100")

    def least_memory(p):
        req = Request(gpus=1, global_batch=4, memory_limit=1e15)
        ev = Evaluator(p, dev, 1e15, 4)
        best = math.inf
        for lay in _every_layout(p, req):
            bounds = balanced_partition([sum(ev.unit_times(u.kind, lay)) for u in p.units], lay.num_stages)
            for rc in (False, True):
                best = min(best, max(ev.evaluate(lay, Partition(bounds, (rc,) * lay.num_stages)).peak_memory))
        return best

    plain, chunked = least_memory(prof), least_memory(prof.chunked)
    assert chunked < plain
    limit = (plain + chunked) / 2
    res = plan(prof, dev, Request(gpus=1, global_batch=4, memory_limit=limit, exhaustive=True))
    assert res.chosen is not None and res.chosen.loss_chunk == 128
    assert max(res.chosen.estimate.peak_memory) <= limit
    assert to_plan(res, res.chosen).loss_chunk_tokens == 128
    off = plan(prof, dev, Request(gpus=1, global_batch=4, memory_limit=limit, exhaustive=True, loss_chunking=False))
    assert off.chosen is None
    roomy = plan(prof, dev, Request(gpus=1, global_batch=4, memory_limit=80e9))
    assert roomy.chosen.loss_chunk == 0


def test_planner_offloads_activations_where_memory_binds():
    """Issue 35 M4: at a limit no layout meets keeping every saved activation on the device
    without recomputing (every layout priced, balanced stages, the element-wise values made
    again in the backward: the first memory feature, ``Plan.remake``), the search parks them on the
    host between F and I/W, and its Plan says so: faster than the best it finds without offload
    (which must recompute, on an h100 profile where the copies hide behind compute); with room
    to spare nothing is offloaded."""
    import dataclasses

    from autopar.examples.gpt import make_gpt
    from autopar.planner.search import to_plan

    model, inputs, target, loss = make_gpt(n_layer=4, d_model=64, n_head=4, seq_len=128, batch_size=1)
    prof = profile_model(model, inputs, target, loss, name="gpt-64", n_heads=4)
    dev = get_profile("h100")
    kw = dict(gpus=2, global_batch=8, loss_chunking=False, schedules=("1f1b", "zb-h1"), pin={"pp": 2})

    def least_memory(offload):
        req = Request(memory_limit=1e15, **kw)
        ev = Evaluator(prof, dev, 1e15, 8).remade
        best = math.inf
        for lay in (x for x in _every_layout(prof, req) if x.pp == 2):
            bounds = balanced_partition([sum(ev.unit_times(u.kind, lay)) for u in prof.units], lay.num_stages)
            est = ev.evaluate(dataclasses.replace(lay, offload=offload), Partition(bounds, (False,) * lay.num_stages))
            best = min(best, max(est.peak_memory))
        return best

    plain, parked = least_memory(0.0), least_memory(1.0)
    assert parked < plain
    limit = (plain + parked) / 2
    res = plan(prof, dev, Request(memory_limit=limit, exhaustive=True, **kw))
    c = res.chosen
    assert c is not None and c.offload and c.remake
    assert not any(c.estimate.partition.recompute)
    assert max(c.estimate.peak_memory) <= limit
    assert to_plan(res, c).offload == c.offload
    # per stage, the least share that fits: under 1f1b the last stage's F is followed by its own B
    # (nothing to gain there), and the first stage's share is the least the evaluator accepts
    assert c.layout.schedule == "1f1b" and isinstance(c.offload, tuple), c.offload
    first, last = c.offload
    assert last == 0 and 0 < first < 1
    ev = Evaluator(prof, dev, limit, 8).remade
    for share, fits in ((first, True), (first - 0.01, False)):
        est = ev.evaluate(dataclasses.replace(c.layout, offload=(share, 0.0)), c.estimate.partition)
        assert est.feasible == fits, (share, est.peak_memory, limit)
    from autopar.planner.report import text

    host = res.chosen.estimate.host_bytes
    assert host[0] > 0 and f"rank 0: {host[0] / GiB:.2f} GiB parked" in text(res, {})
    without = plan(prof, dev, Request(memory_limit=limit, exhaustive=True, offloading=False, **kw)).chosen
    assert without is None or (any(without.estimate.partition.recompute) and res.chosen.time < without.time)
    assert plan(prof, dev, Request(memory_limit=80e9, **kw)).chosen.offload == 0


@pytest.mark.parametrize("name,pp,m", [("1f1b", 3, 9), ("zb-h1", 3, 8), ("zbv", 2, 9), ("dualpipev", 2, 10),
                                       ("interleaved-1f1b", 2, 8), ("v-min", 3, 9), ("v-half", 2, 6),
                                       ("gpipe", 2, 5)])
def test_offload_points_give_the_walks_peaks(name, pp, m):
    """The planner's offload peaks from cached count points (``points_peaks``, walked at
    ``steady_m`` past the warm-up) equal ``offload_peaks`` walking every action of the schedule
    built at the full m, device and host, for uneven amounts and shares per stage (what only W
    reads within what a microbatch keeps after F and after I, as the estimate has it: the points
    another of the same action dominates are left out on that ground)."""
    import random

    from autopar.planner.estimate import offload_peaks, offload_points, points_peaks
    from autopar.schedules import default_stages_per_rank

    v = default_stages_per_rank(name)
    sched = build(name, pp, m, v)
    rng = random.Random(pp * 100 + m)
    S = pp * v
    for _ in range(3):
        after_f = [rng.uniform(100, 1000) for _ in range(S)]
        after_i = [a * rng.uniform(0.5, 1.5) for a in after_f]
        movable = [a * rng.choice((1.0, rng.uniform(0.3, 1))) for a in after_f]  # a MoE's rows stay
        w_only = [min(a, b) * rng.uniform(0, 1) for a, b in zip(movable, after_i)]  # within what I keeps
        shares = [rng.choice((0.0, 1.0, rng.random())) for _ in range(S)]
        want = offload_peaks(sched, after_f, after_i, [f * a for f, a in zip(shares, movable)],
                             [f * w for f, w in zip(shares, w_only)])
        got = points_peaks(offload_points(name, pp, m, v), after_f, after_i, movable, w_only, shares)
        for g, w in zip(got, want):
            assert g == pytest.approx(w, rel=1e-12), (name, got, want)


def test_least_offload_shares_by_hand():
    """Issue 35 item 2: the least offload shares that fit a rank's budget, from the points of its
    actions' walk. 1F1B at pp=2, m=4, a microbatch keeps ``a`` bytes after F: rank 0 holds 2
    microbatches after its warm-up F; at share f its peak is a(2 - f) (when B0 brings back what
    F0 parked while F1's whole output is on the device), so a budget of 1.5a needs f = 0.5;
    rank 1 runs B right after each F and never holds more than a: nothing to offload; a budget
    below a fits at no share. Under zbv (two stages a rank) at m=10, past the warm-up the points
    are taken from (``steady_m``), the shares found fit by ``offload_peaks`` walking the whole
    built schedule, and where one stage sufficed a hair less of it does not fit."""
    from autopar.planner.estimate import least_offload, offload_peaks, offload_points, offload_terms

    a = 1000.0

    def terms(name, pp, m, v, r, after_f, after_i, w_only):
        stages, points = offload_points(name, pp, m, v)[r]
        return stages, offload_terms(stages, points, after_f, after_i, after_f, w_only)

    got = [least_offload(terms("1f1b", 2, 4, 1, r, (a, a), (a, a), (0.0, 0.0))[1], 1.5 * a, [r], (a, a))
           for r in range(2)]
    assert got == [{0: 0.5}, {1: 0.0}]
    assert least_offload(terms("1f1b", 2, 4, 1, 0, (a, a), (a, a), (0.0, 0.0))[1], 0.99 * a, [0], (a, a)) is None
    zbv = build("zbv", 2, 10)
    after_f, after_i, w_only = (4000.0, 3000.0, 2000.0, 1000.0), (4500.0, 3200.0, 2600.0, 1400.0), (900.0,) * 4

    def peak(f, r):
        return offload_peaks(zbv, after_f, after_i, [x * y for x, y in zip(f, after_f)],
                             [x * min(w, y) for x, w, y in zip(f, w_only, after_f)])[0][r]
    cases = set()
    for r in range(2):
        stages, lin = terms("zbv", 2, 10, 2, r, after_f, after_i, w_only)
        full = peak([0.0] * 4, r)
        assert full == max(c for c, _ in lin)
        for budget in (0.9 * full, 0.7 * full, 0.5 * full):
            shares = least_offload(lin, budget, list(stages), after_f)
            if shares is None:  # then parking everything of the rank is not enough
                assert peak([1.0 if s in stages else 0.0 for s in range(4)], r) > budget
                cases.add("none")
                continue
            f = [shares.get(s, 0.0) for s in range(4)]
            assert peak(f, r) <= budget * (1 + 1e-9), (r, budget, shares)
            raised = [s for s in stages if f[s] > 0]
            cases.add(len(raised))
            if len(raised) == 1:
                lower = list(f)
                lower[raised[0]] -= 0.002
                assert peak(lower, r) > budget, (r, budget, shares)
    assert cases == {1, 2, "none"}


# ------------------------------------------------------------- Muon (issue 36 item 3)
def test_muon_prices_one_momentum_and_newton_schulz(gpt_profile, mixtral_profile):
    """``optimizer="muon"``: the units' Muon matrices are the blocks' 2-D weights (hand list of
    examples/gpt: qkv [3d, d], proj [d, d], fc [4d, d], proj [d, 4d]; Mixtral: attention, and
    every expert's w1/w2/w3, not the router); each keeps one fp32 momentum instead of Adam's two
    (4 bytes less an element, sharded like the optimizer state), and the step adds
    Newton-Schulz (5 x (4 m^2 n + 2 m^3) FLOPs a matrix, m <= n) at the bf16 matmul rate."""
    d = 32
    block = next(k for k in gpt_profile.kinds if k.kind.startswith("blocks"))
    shapes = [(3 * d, d), (d, d), (4 * d, d), (d, 4 * d)]
    assert block.muon_params == sum(a * b for a, b in shapes)
    assert block.muon_flops == sum(5 * (4 * min(s) ** 2 * max(s) + 2 * min(s) ** 3) for s in shapes)
    assert all(k.muon_params == 0 for k in gpt_profile.kinds if not k.kind.startswith("blocks"))  # embeddings, head
    dev = get_profile("h100")
    adam, muon = (Evaluator(gpt_profile, dev, 80e9, 8, optimizer=o) for o in ("adamw", "muon"))
    for dp, zero in [(1, 0), (4, 0), (4, 1), (4, 2), (4, 3)]:
        lay = Layout(1, dp, 1, 1, "1f1b", 1, 2, 1, zero)
        g = dp if zero >= 1 else 1
        assert adam.unit_static(block, lay) - muon.unit_static(block, lay) == pytest.approx(
            4 * block.muon_params / g, rel=1e-12), (dp, zero)
        assert muon.muon_time(lay, [block]) == pytest.approx(
            block.muon_flops / g / dev.flops_rate("bfloat16")
            - block.muon_params / g * 36 / muon.stream_bandwidth(lay), rel=1e-12)
        assert adam.muon_time(lay, [block]) == 0.0
    moe = next(k for k in mixtral_profile.kinds if k.expert_params)
    assert moe.muon_expert_params == moe.expert_params            # every expert weight is a matrix
    assert moe.params - moe.small_params - moe.muon_params > 0      # the router is not
    with pytest.raises(ValueError, match="optimizer must be one of"):
        Evaluator(gpt_profile, dev, 80e9, 8, optimizer="lion")


def test_cli_optimizer_muon(capsys):
    from autopar.planner.cli import main

    assert main(["mixtral-8x7b", "--gpus", "64", "--device", "h100", "--global-batch", "128", "--seq", "1024",
                 "--optimizer", "muon", "--pin", "pp=4,ep=8,zero=1"]) == 0
    out = capsys.readouterr().out
    assert "optimizer: Muon on" in out and "less optimizer state than Adam" in out


def test_cli_lengths_reports_real_tokens(capsys, tmp_path):
    """Issue 37 item 4: ``--lengths FILE``: documents of 3/4 of a row (one a row: fill 0.75, pairs
    within documents (3/4)^2 of full rows') and a pair that shares a row; real tokens/s is the
    plan's tokens/s times the fill (hand values)."""
    seq = 32  # make_gpt's default sequence length
    lengths = [24] * 6 + [20, 12]  # six rows of one document, one row of two
    path = tmp_path / "lengths.txt"
    path.write_text("# document lengths\n" + "\n".join(map(str, lengths)) + "\n\n")
    args = ["--model", "autopar.examples.gpt:make_gpt", "--gpus", "2", "--global-batch", "16", "--device", "h100",
            "--quiet", "--lengths", str(path)]
    assert plan_main(args + ["--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    p = data["packed"]
    assert (p["documents"], p["tokens"], p["rows"]) == (8, 176, 7)
    assert p["fill"] == pytest.approx(176 / (7 * seq))
    assert p["attention_share"] == pytest.approx((6 * 24 ** 2 + 20 ** 2 + 12 ** 2) / (7 * seq ** 2))
    assert data["real_tokens_per_s"] == pytest.approx(data["tokens_per_s"] * 176 / (7 * seq))
    assert plan_main(args) == 0
    assert "packed documents" in capsys.readouterr().out
    path.write_text("24\nlots\n")
    assert plan_main(args) == 2
    assert "line 2" in capsys.readouterr().err


def test_highs_node_budget_reads_as_feasible():
    """With highspy installed, PuLP's HiGHS is the solver; a solve stopped at its node budget
    (HiGHS >= 1.10: kSolutionLimit, a status PuLP 3.3 does not map) returns its feasible
    partition, as CBC's does, not a KeyError. Runs where highspy is installed."""
    pytest.importorskip("highspy")
    pm = presets.build_preset("llama3-8b", seq_len=256)
    prof = profile_model(pm.model, pm.inputs, pm.target, pm.loss_fn, name=pm.name, layer_repeats=pm.layer_repeats,
                         n_heads=pm.n_heads, seq_len=256)
    ev = Evaluator(prof, get_profile("h100"), 80 * GiB, global_batch=64)
    res = solve_partition(ev, Layout(4, 1, 1, 1, "zbv", 2, 16, 1, 0), build("zbv", 4, 16, 2), 0.5, max_nodes=1)
    assert res.partition is not None and "node limit" in res.status, res.status


def test_muon_zero3_prices_whole_matrix_padding():
    """Under ZeRO-3 each layer's Muon matrices are dealt whole to the replicas (parallel/
    zero_layout.aligned_offsets): Llama-3-8B's 7 matrices a layer over dp=8 give one each to 7
    replicas, so every shard is as large as the largest matrix (14336 x 4096): the layer's
    Muon group is 8 x 14336 x 4096 elements (hand value), where AdamW packs 13 x 4096^2 / 8 a
    replica; the master shards priced follow."""
    pm = presets.build_preset("llama3-8b", seq_len=256)
    prof = profile_model(pm.model, pm.inputs, pm.target, pm.loss_fn, name=pm.name, layer_repeats=pm.layer_repeats,
                         n_heads=pm.n_heads, seq_len=256)
    lay = Layout(1, 8, 1, 1, "1f1b", 1, 8, 1, 3)
    part = Partition((0, len(prof.units)), (False,))
    zls = {o: Evaluator(prof, get_profile("h100"), 80 * GiB, 64, optimizer=o)._zero_layout(lay, part, (0,), 0)[0]
           for o in ("adamw", "muon")}
    layer = [g for g in zls["muon"].groups if g.name == "layers.5/1"]
    assert len(layer) == 1 and layer[0].padded == 8 * 14336 * 4096
    assert [g.name for g in zls["adamw"].groups if g.name.startswith("layers.5")] == ["layers.5"]
    assert zls["muon"].shard_numel > zls["adamw"].shard_numel + 31 * (14336 * 4096 - 13 * 4096 ** 2 // 8)


def test_muon_worst_replica_and_padding():
    """Newton-Schulz and the collectives follow the whole-matrix dealing (hand values, Llama-3-8B
    at dp=8, one stage): under ZeRO-3 each layer's 7 matrices go one to a replica, so the
    replica that steps the most does one 14336 x 4096 matrix a layer (32 of them) and each layer
    pads 8 x 14336 x 4096 - 13 x 4096^2 elements; ZeRO-1 deals all 224 matrices at once, within
    a few percent of an eighth of the work each, with little padding."""
    from autopar.passes.zero_layout import ns_flops

    pm = presets.build_preset("llama3-8b", seq_len=256)
    prof = profile_model(pm.model, pm.inputs, pm.target, pm.loss_fn, name=pm.name, layer_repeats=pm.layer_repeats,
                         n_heads=pm.n_heads, seq_len=256)
    ev = Evaluator(prof, get_profile("h100"), 80 * GiB, 64, optimizer="muon")
    part = Partition((0, len(prof.units)), (False,))
    pad, worst = ev.muon_dealt(Layout(1, 8, 1, 1, "1f1b", 1, 8, 1, 3), part, (0,), 0)
    assert worst == 32 * ns_flops((14336, 4096))
    assert pad == 32 * (8 * 14336 * 4096 - 13 * 4096 ** 2)
    total = sum(u.kind.muon_flops for u in prof.units)
    pad1, worst1 = ev.muon_dealt(Layout(1, 8, 1, 1, "1f1b", 1, 8, 1, 1), part, (0,), 0)
    assert total / 8 <= worst1 <= 1.05 * total / 8 and pad1 <= 0.05 * sum(u.kind.muon_params for u in prof.units)
    assert ev.muon_dealt(Layout(1, 8, 1, 1, "1f1b", 1, 8, 1, 0), part, (0,), 0) is None  # every replica steps all


def test_pin_v_gives_interleaved_more_stages_per_rank(gpt_profile):
    """``--pin v=3`` with interleaved-1f1b: layouts of 3 stages a rank (the search otherwise tries
    each schedule's default, 2), carried into the runtime plan; a V schedule refuses v=3."""
    dev = get_profile("h100")
    kw = dict(gpus=2, global_batch=8, memory_limit=80e9)
    res = plan(gpt_profile, dev, Request(**kw, pin={"pp": 2, "schedule": "interleaved-1f1b", "v": 3}))
    assert res.chosen is not None and res.chosen.layout.v == 3
    from autopar.planner.search import to_plan

    assert to_plan(res, res.chosen).stages_per_rank == 3
    res = plan(gpt_profile, dev, Request(**kw, pin={"pp": 2, "schedule": "zbv", "v": 3}))
    assert res.chosen is None and any("stages_per_rank" in c.reason for c in res.candidates)
