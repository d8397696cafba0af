"""passes/moe_dispatch: the dropless experts op equals a per-token brute force in plain PyTorch
(tests/reference.py PlainMoE: every token's k experts, whatever the routing), keeps its I/W
split through capture and pipelining (recompute included) with nothing left behind, and
routing over the priced ratio warns while the user's hard limit names the layer and the counts."""
import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autopar
from autopar.collectives import moe_exchange
from autopar.nn import MoE
from autopar.passes import moe_dispatch
from tests.reference import PlainMoE, plain_moe


@pytest.mark.parametrize("k, skew", [(2, False), (4, False), (2, True)])
def test_dropless_equals_brute_force(k, skew):
    """k=2 of 4, k=E (every expert), and a router that sends every token to experts 0 and 1
    (a static capacity of 1.0 would drop half of them)."""
    torch.manual_seed(0)
    moe = MoE(8, 12, 4, k, n_shared_experts=1, capacity_factor=None, aux_loss_weight=0.1)
    x = torch.randn(3, 5, 8)
    if skew:
        with torch.no_grad():
            x[..., 0] = 1.0
            moe.router.weight[:2, 0] = 50.0
    ref = PlainMoE(moe)  # plain PyTorch: a Python loop over the experts and the rows that chose them
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    y, aux = moe(xa)
    y_ref, aux_ref = ref(xb)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(aux, aux_ref)
    (y.square().sum() + aux).backward()
    (y_ref.square().sum() + aux_ref).backward()
    torch.testing.assert_close(xa.grad, xb.grad, rtol=1e-5, atol=1e-6)
    theirs = dict(ref.named_parameters())
    assert set(theirs) == {n for n, _p in moe.named_parameters()}
    for name, p in moe.named_parameters():
        torch.testing.assert_close(p.grad, theirs[name].grad, rtol=1e-5, atol=1e-6, msg=name)
    if skew:
        assert moe.route(x.reshape(-1, 8))[0].max() <= 1  # really only experts 0 and 1
    assert moe_exchange.live_handles([moe.experts._autopar_dispatch]) == 0
    with torch.no_grad():  # a forward with no backward to come (evaluation) keeps nothing either
        moe(x)
    assert moe_exchange.live_handles([moe.experts._autopar_dispatch]) == 0


class _Net(nn.Module):
    """linear -> dropless MoE (a shared expert) -> linear -> dropless MoE -> head; (out, aux)."""

    def __init__(self, d=16, hidden=24, experts=4, k=2):
        super().__init__()
        self.inp = nn.Linear(6, d)
        self.moe1 = MoE(d, hidden, experts, k, n_shared_experts=1, capacity_factor=None, aux_loss_weight=0.1)
        self.mid = nn.Linear(d, d)
        self.moe2 = MoE(d, hidden, experts, k, capacity_factor=None, aux_loss_weight=0.1)
        self.head = nn.Linear(d, 3)

    def forward(self, x):
        h = self.inp(x)
        y, a1 = self.moe1(h)
        h = self.mid(h + y)
        y, a2 = self.moe2(h)
        return self.head(h + y), a1 + a2


def _loss(out, t):
    y, aux = out
    return F.mse_loss(y, t) + aux


def _step_equals_eager(pm, ref, ref_opt, x, t) -> None:
    """One step of ``pm`` against the eager reference's gradient accumulation over the same 4
    microbatches; no dispatch state of ``pm``'s model outlives it."""
    loss = pm.step((x,), t)
    ref_opt.zero_grad()
    want = 0.0
    for xm, tm in zip(x.chunk(4), t.chunk(4)):
        part = _loss(ref(xm), tm) / 4
        part.backward()
        want += part.item()
    ref_opt.step()
    assert float(loss) == pytest.approx(want, rel=1e-5)
    assert moe_exchange.live_handles(pm.built.moe_entries) == 0


def _two_steps_equal_eager(net, plan, before_step=lambda: None):
    """Two SGD steps of ``parallelize(net, plan)`` (4 microbatches) equal eager gradient
    accumulation over the same microbatches (of the plain-PyTorch reference: tests/reference.py
    ``plain_moe``), and no dispatch state outlives a step."""
    ref = plain_moe(net)
    x, t = torch.randn(8, 3, 6), torch.randn(8, 3, 3)
    pm = autopar.parallelize(net, (x,), _loss, functools.partial(torch.optim.SGD, lr=0.1), plan, example_target=t)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(2):
        before_step()
        _step_equals_eager(pm, ref, ref_opt, x, t)
    state = pm.state_dict()
    for name, value in ref.state_dict().items():
        torch.testing.assert_close(state[name], value, rtol=1e-4, atol=1e-6, msg=name)
    return pm


@pytest.mark.parametrize("schedule, recompute", [("zbv", ()), ("1f1b", (0, 1))])
def test_dropless_pipeline_matches_eager(schedule, recompute):
    """pp=2 (local mode) with the op's backward split into I and W (zbv runs W late), and with
    recomputation (the op is saved, never replayed): two SGD steps equal eager gradient
    accumulation over the same microbatches, and no dispatch state outlives a step."""
    torch.manual_seed(0)
    pm = _two_steps_equal_eager(_Net(), autopar.Plan(pp=2, schedule=schedule, num_microbatches=4,
                                                      recompute=recompute))
    programs = [p for p in pm.built.programs if hasattr(p, "f")]
    ops = {kind: {n.target for p in programs for n in getattr(p, kind).gm.graph.nodes if n.op == "call_function"}
           for kind in ("f", "i", "w")}
    grad_input, grad_weight = (torch.ops.autopar.moe_dispatch_grad_input.default,
                               torch.ops.autopar.moe_dispatch_grad_weight.default)
    assert torch.ops.autopar.moe_dispatch.default in ops["f"]
    assert grad_weight in ops["w"] and grad_weight not in ops["i"]
    assert grad_input in ops["i"] or grad_input in ops["w"]  # stage 0 has no input gradient: its I is empty
    assert torch.ops.autopar.moe_dispatch.default not in ops["i"] | ops["w"]  # never recomputed
    # a recomputing stage's experts keep only their input rows (F) and run again in I
    flags = [n.args[5] if len(n.args) > 5 else False for p in programs for n in p.f.gm.graph.nodes
             if n.target is torch.ops.autopar.moe_dispatch_experts.default]
    assert flags and all(flags) == bool(recompute) and any(flags) == bool(recompute)
    assert pm.metrics["moe_receive_ratio"] == pytest.approx(1.0)  # one rank: it receives every row
    assert pm.metrics["moe_max_receive_rows"] == 2 * 2 * 3  # microbatch of 2 x 3 tokens, top-2


def test_over_the_priced_ratio_warns_and_the_hard_limit_fails(caplog, monkeypatch):
    """[source rank, expert] counts in which rank 0's experts (0, 1) get 7 + 5 + 6 + 2 = 20 rows
    and rank 1's 4: 1.67x the mean 12. Over the priced 1.25x the dispatch goes on and warns
    once per WARN_EVERY_S with the bytes beyond the price ((20 - 1.25 * 12) rows x 10 fp32
    elements = 200 B); over the user's hard limit it raises, naming the layer and the counts."""
    spec = moe_exchange.ExpertsEntry(run=None, names=(), layer="model.layers.3.mlp", n_experts=4, flops_per_row=0,
                                 saved_row_elems=10, priced=1.25)
    table = torch.tensor([[7, 5, 0, 0], [6, 2, 3, 1]])
    clock = [1000.0]
    monkeypatch.setattr(moe_exchange.time, "monotonic", lambda: clock[0])
    with caplog.at_level("WARNING", logger="autopar"):
        for _ in range(3):
            assert moe_exchange.check_bound(spec, table, ep=2, n_local=2, row_bytes=40) == [20, 4]
        clock[0] += moe_exchange.WARN_EVERY_S
        moe_exchange.check_bound(spec, table, ep=2, n_local=2, row_bytes=40)
    lines = [r.getMessage() for r in caplog.records if "model.layers.3.mlp" in r.getMessage()]
    assert len(lines) == 2, lines  # the first, then one after WARN_EVERY_S counting the 3 since
    assert "received 20 routed rows, 1.67x the mean 12.0" in lines[0] and "1.25x" in lines[0], lines[0]
    assert f"{200 / 2**20:.1f} MiB" in lines[0] and "(1 such dispatch" in lines[0] and "(3 such" in lines[1], lines
    assert (spec.stats.calls, spec.stats.over, spec.stats.max_rows) == (4, 4, 20)
    spec.receive_bound = 1.5
    with pytest.raises(moe_exchange.ReceiveBoundError, match=r"model\.layers\.3\.mlp.*rank 0 would receive 20 routed "
                                                             r"rows, 1\.67x the mean 12\.0 \(per-rank receives "
                                                             r"\[20, 4\]\).*hard limit of 1\.5x"):
        moe_exchange.check_bound(spec, table, ep=2, n_local=2)
    spec.receive_bound = 2.0
    assert moe_exchange.check_bound(spec, table, ep=2, n_local=2) == [20, 4]
    for field in ("moe_imbalance", "moe_receive_limit"):
        with pytest.raises(ValueError, match=f"{field}=0.5 must be a number >= 1"):
            autopar.Plan(**{field: 0.5})


def test_per_row_costs_are_the_experts_gemms():
    """The planner's per-row numbers, measured on fake tensors: SwiGLU's three GEMMs (2 * 3 * d * h)."""
    moe = MoE(8, 12, 4, 2, capacity_factor=None)
    spec = moe.experts._autopar_dispatch
    assert spec.flops_per_row == 2 * 3 * 8 * 12
    assert spec.saved_row_elems >= 8 + 3 * 12  # the row, x @ w1, x @ w3 and the product at least


def _op_positions(gm, targets):
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    return {t: [i for i, n in enumerate(nodes) if n.target is t] for t in targets}, nodes


def test_dispatch_chains_spread_over_independent_work():
    """passes/moe_overlap.py: in F the shared expert's three GEMMs (independent of the routed
    rows) run between the rows' all-to-all start and the experts (half of their FLOPs) and between
    the experts and the combine's wait; in the backward its input-gradient GEMMs sit inside the
    backward chain; the recorded window FLOPs are those GEMMs' (2 * tokens * d * h each); one
    step equals eager."""
    torch.manual_seed(0)
    net = _Net()
    ref = plain_moe(net)
    x, t = torch.randn(4, 3, 6), torch.randn(4, 3, 3)
    pm = autopar.parallelize(net, (x,), _loss, functools.partial(torch.optim.SGD, lr=0.1),
                             autopar.Plan(pp=1, num_microbatches=1), example_target=t)
    loss = pm.step((x,), t)
    want = _loss(ref(x), t)
    want.backward()
    assert float(loss) == pytest.approx(want.item(), rel=1e-5)
    ops = torch.ops.autopar
    send, experts, combine = (ops.moe_dispatch_send.default, ops.moe_dispatch_experts.default,
                              ops.moe_dispatch.default)
    prog = next(p for p in pm.built.programs if hasattr(p, "f"))
    pos, nodes = _op_positions(prog.f.gm, (send, experts, combine, torch.ops.aten.mm.default))
    s, e, c = pos[send][0], pos[experts][0], pos[combine][0]  # moe1: the block with a shared expert
    shared = [i for i in pos[torch.ops.aten.mm.default] if s < i < c]
    assert len(shared) == 3 and min(shared) < e < max(shared)
    gemm = 2 * 12 * 16 * 24  # tokens x d_model x expert hidden (the shared expert's width)
    record = nodes[c].meta["autopar_moe_overlap"]
    assert sum(record["F"]) == 3 * gemm and record["F"][0] >= record["F"][1] > 0
    assert nodes[pos[combine][1]].meta["autopar_moe_overlap"]["F"] == (0, 0)  # moe2: nothing independent
    # backward (stage 0 has no input gradient: its chains run in W)
    pos, nodes = _op_positions(prog.w.gm, (ops.moe_dispatch_grad_send.default, ops.moe_dispatch_grad_input.default,
                                           ops.moe_dispatch_grad_combine.default, torch.ops.aten.mm.default))
    gs, gi, gc = (max(pos[o]) for o in (ops.moe_dispatch_grad_send.default, ops.moe_dispatch_grad_input.default,
                                         ops.moe_dispatch_grad_combine.default))  # moe1's chain runs last
    inside = [i for i in pos[torch.ops.aten.mm.default] if gs < i < gc]
    assert any(i < gi for i in inside) and any(i > gi for i in inside)
    assert sum(record["I"]) > 0


class _DeepNet(nn.Module):
    """Four dropless MoE blocks (one per DualPipeV stage at pp=2, so every F&B unit pairs two chains)."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(6, 16)
        self.blocks = nn.ModuleList(MoE(16, 24, 4, 2, capacity_factor=None, aux_loss_weight=0.1) for _ in range(4))
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        h = self.inp(x)
        aux = 0.0
        for moe in self.blocks:
            y, a = moe(h)
            h, aux = h + y, aux + a
        return self.head(h), aux


def test_dualpipev_units_interleave_their_dispatch_chains(monkeypatch):
    """DualPipeV's F&B units run their two programs alternately at the chains' in-flight points
    (runtime/execute.py run_paired): an F's rows leave, then the paired backward's gradient rows
    leave before that F's experts run; two steps equal eager."""
    events = []
    for name in ("send_rows", "run_experts", "send_grads", "input_grads"):
        real = getattr(moe_exchange, name)
        monkeypatch.setattr(moe_exchange, name, functools.partial(
            lambda real, name, *a, **kw: events.append(name) or real(*a, **kw), real, name))
    torch.manual_seed(0)
    pm = _two_steps_equal_eager(_DeepNet(), autopar.Plan(pp=2, schedule="dualpipev", num_microbatches=4),
                                before_step=events.clear)
    units = sum(len(pm.built.executor.units(r)) for r in range(2))
    assert units > 0
    interleaved = sum(a == "send_rows" and b == "send_grads" for a, b in zip(events, events[1:]))
    # run apart, an F's send is always followed by its own experts: only the units interleave
    assert 0 < interleaved <= 2 * units


def test_two_models_in_one_process_own_their_dispatch_state():
    """Two ParallelModels of different MoE models step alternately (one at pp=2 zbv, W late):
    each equals its plain-PyTorch eager run, each one's metrics count only its own dispatches
    (2 blocks x 4 microbatches each), neither leaves a state behind, and a freed model
    takes its dispatch entries (runner, statistics, states) with it."""
    import gc
    import weakref

    torch.manual_seed(0)
    nets = [_Net(), _Net(d=8, hidden=12, experts=8, k=1)]  # another MoE model: 8 experts, top-1
    plans = [autopar.Plan(pp=2, schedule="zbv", num_microbatches=4), autopar.Plan(pp=1, num_microbatches=4)]
    refs = [plain_moe(n) for n in nets]
    x, t = torch.randn(8, 3, 6), torch.randn(8, 3, 3)
    pms = [autopar.parallelize(n, (x,), _loss, functools.partial(torch.optim.SGD, lr=0.1), p, example_target=t)
           for n, p in zip(nets, plans)]
    opts = [torch.optim.SGD(r.parameters(), lr=0.1) for r in refs]
    for _ in range(2):
        for pm, ref, opt in zip(pms, refs, opts):
            _step_equals_eager(pm, ref, opt, x, t)
            assert pm.metrics["moe_max_receive_rows"] > 0
            assert moe_exchange.receive_stats(pm.built.moe_entries)["dispatches"] == 2 * 4
    for pm, ref in zip(pms, refs):
        state = pm.state_dict()
        for name, value in ref.state_dict().items():
            torch.testing.assert_close(state[name], value, rtol=1e-4, atol=1e-6, msg=name)
    key = nets[1].moe1.experts._autopar_dispatch_key
    alive = weakref.ref(nets[1].moe1.experts._autopar_dispatch)
    # outside a model's step no experts module is served: the op names the key and where it runs
    with pytest.raises(RuntimeError, match=rf"MoE dispatch key {key}: no running model serves"):
        moe_exchange.entry(key)
    del pms[1], nets[1], opts, refs, pm, ref
    gc.collect()
    assert alive() is None
    assert pms[0].step((x,), t) is not None  # the other model runs on
    # no process-wide state in the dispatch code: no module-level container or counter, only the
    # context variables that say what is served where the ops run
    import itertools

    for mod in (moe_dispatch, moe_exchange):
        held = {name: type(v).__name__ for name, v in vars(mod).items() if not name.startswith("__")
                and isinstance(v, (dict, list, set, bytearray, weakref.WeakValueDictionary,
                                   weakref.WeakKeyDictionary, itertools.count))}
        assert not held, (mod.__name__, held)
