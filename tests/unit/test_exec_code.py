"""passes/exec_code: what the runtime runs computes exactly what the stage GraphModules compute.

The compiled programs drop detach, t(t(x)) and view(view(x)) chains, bind ops as globals, and
merge a norm/conv backward that split_backward cut in two when both halves are in one program
(the fused B). Checked on real step values of examples/gpt (LayerNorm) and a CNN with
BatchNorm (convolution_backward, native_batch_norm_backward), bit for bit.
"""
import functools
import operator

import pytest
import torch
import torch.fx as fx

import autopar
from autopar.passes.exec_code import _MASKED, compile_for_execution, simplify
from autopar.passes.program import Program
from autopar.runtime import execute
from tests.models import make_cnn_bn, make_gpt

aten = torch.ops.aten


def _recorded_programs(case, monkeypatch):
    """(program, args) of every program call of one pp=2 local step, first call of each."""
    torch.set_num_threads(1)
    pm = autopar.parallelize(case.model, case.inputs, loss_fn=case.loss_fn,
                             optimizer=functools.partial(torch.optim.SGD, lr=0.1),
                             plan=autopar.Plan(pp=2, schedule="1f1b", num_microbatches=2), example_target=case.target)
    seen = {}
    original = execute.run

    def recording(prog, env, state, accumulate=(), into=None, keep=None):
        seen.setdefault(id(prog), (prog, [env[k] if k in env else state[k] for k in prog.args]))
        return original(prog, env, state, accumulate, into, keep)

    monkeypatch.setattr("autopar.runtime.stage_work.run", recording)
    pm.step(case.inputs, case.target)
    monkeypatch.undo()
    return pm, list(seen.values())


def _flat(values):
    for v in values:
        if isinstance(v, (tuple, list)):
            yield from _flat(v)
        else:
            yield v


def _simplified(gm: fx.GraphModule) -> fx.Graph:
    g = fx.Graph()
    g.output(g.graph_copy(gm.graph, {}))
    simplify(g)
    return g


def _calls(graph: fx.Graph, targets) -> list[fx.Node]:
    return [n for n in graph.nodes if n.op == "call_function" and n.target in targets]


@pytest.mark.parametrize("make", [make_gpt, make_cnn_bn], ids=["gpt", "cnn_bn"])
def test_compiled_programs_match_graph_modules_bitwise(make, monkeypatch):
    pm, calls = _recorded_programs(make(), monkeypatch)
    kinds = set()
    for prog, args in calls:
        kinds.add(type(prog.gm).__name__.rsplit("_", 1)[1])
        with torch.no_grad():
            ref = list(_flat(prog.gm(*args)))
            got = list(_flat(compile_for_execution(prog.gm)(list(args))))
        assert len(ref) == len(got)
        for r, g in zip(ref, got):
            if r is None:
                assert g is None
            else:
                assert g.shape == r.shape and g.dtype == r.dtype and torch.equal(g, r), type(prog.gm).__name__
    assert kinds == {"F", "B"}  # 1f1b runs F and fused B


@pytest.mark.parametrize("make", [make_gpt, make_cnn_bn], ids=["gpt", "cnn_bn"])
def test_peepholes_remove_chains_and_merge_cut_backward_ops(make, monkeypatch):
    pm, _ = _recorded_programs(make(), monkeypatch)
    merged_any = False
    for sp in pm.programs:
        for prog in (sp.f, sp.i, sp.w, sp.b):
            g = _simplified(prog.gm)
            g.lint()
            out = next(n for n in g.nodes if n.op == "output")
            assert not [n for n in _calls(g, {aten.detach.default}) if out not in n.users]
            assert not [n for n in _calls(g, {aten.t.default})
                        if getattr(n.args[0], "target", None) is aten.t.default]
            assert not [n for n in _calls(g, {aten.view.default})
                        if getattr(n.args[0], "target", None) is aten.view.default]
            before = len(_calls(prog.gm.graph, {aten.t.default, aten.view.default, aten.detach.default}))
            after = len(_calls(g, {aten.t.default, aten.view.default, aten.detach.default}))
            assert after <= before
        # B = I + W: every op that I and W each call with half of the mask is one call in B
        n_i = len(_calls(sp.i.gm.graph, _MASKED))
        n_w = len(_calls(sp.w.gm.graph, _MASKED))
        b_calls = _calls(_simplified(sp.b.gm), _MASKED)
        assert len(_calls(sp.b.gm.graph, _MASKED)) == n_i + n_w
        assert len(b_calls) == max(n_i, n_w)  # stage 0: I is empty and W has uncut calls
        for n in b_calls:
            mask = n.args[_MASKED[n.target]]
            merged_any |= bool(mask[0]) and any(mask[1:])
    assert merged_any


def test_results_never_become_arguments():
    g = fx.Graph()
    x, a, b = g.placeholder("x"), g.placeholder("a"), g.placeholder("b")
    d = g.call_function(aten.detach.default, (x,))
    tt = g.call_function(aten.t.default, (g.call_function(aten.t.default, (x,)),))
    mm = g.call_function(aten.mm.default, (a, b))
    mm_tt = g.call_function(aten.t.default, (g.call_function(aten.t.default, (mm,)),))
    g.output((d, tt, mm_tt))
    gm = fx.GraphModule(torch.nn.Module(), g)
    simplify(g)
    out = next(n for n in g.nodes if n.op == "output")
    res = out.args[0]
    assert res[0].target is aten.detach.default and res[1].target is aten.t.default
    assert res[2].target is aten.mm.default  # an intermediate may be returned directly
    xs, av, bv = torch.randn(3, 3), torch.randn(3, 4), torch.randn(4, 2)
    fn = compile_for_execution(gm)
    got = fn([xs, av, bv])
    assert got[0] is not xs and got[1] is not xs
    assert torch.equal(got[2], av @ bv) and torch.equal(got[1], xs)
    assert "_op_aten_mm_default(" in fn.__func__.__autopar_source__


def test_program_recompiles_after_its_module_changes():
    g = fx.Graph()
    x = g.placeholder("x")
    g.output((g.call_function(aten.neg.default, (x,)),))
    gm = fx.GraphModule(torch.nn.Module(), g)
    prog = Program(gm=gm, args=("k",), results=("r",))
    env = {"k": torch.ones(2)}
    execute.run(prog, env, {})
    assert torch.equal(env["r"], -torch.ones(2))
    node = next(n for n in gm.graph.nodes if n.op == "call_function")
    node.target = aten.exp.default
    gm.recompile()
    execute.run(prog, env, {})
    assert torch.equal(env["r"], torch.ones(2).exp())
    assert operator.is_(execute.executable(prog), execute.executable(prog))


@pytest.mark.parametrize("make", [make_gpt, make_cnn_bn], ids=["gpt", "cnn_bn"])
def test_accumulating_programs_add_into_the_given_tensors(make, monkeypatch):
    """B with accumulators: every weight gradient is added in place into its accumulator (a
    linear weight's inside its GEMM, addmm_), equal to accumulator + the fresh gradient."""
    _, calls = _recorded_programs(make(), monkeypatch)
    fused_linear = 0
    for prog, args in calls:
        if not type(prog.gm).__name__.endswith("_B"):
            continue
        keys = tuple(k for k in prog.results if k.startswith("gparam:"))
        fn = execute.executable(prog, keys)
        with torch.no_grad():
            fresh = prog.gm(*args)
            gen = torch.Generator().manual_seed(0)
            before = [torch.randn(fresh[prog.results.index(k)].shape, generator=gen) for k in keys]
            accs = [b.clone() for b in before]
            got = fn([*args, *accs])
        for k, acc, b in zip(keys, accs, before):
            i = prog.results.index(k)
            assert got[i] is acc, k
            torch.testing.assert_close(acc, b + fresh[i], rtol=1e-6, atol=1e-6, msg=lambda m: f"{k}: {m}")
        for i, k in enumerate(prog.results):  # the input gradients are untouched by it
            if k not in keys:
                assert torch.equal(got[i], fresh[i]), k
        src = fn.__func__.__autopar_source__
        fused_linear += src.count("= _op_aten_addmm__default(")
    n_linear = sum(1 for m in make().model.modules() if isinstance(m, torch.nn.Linear))
    assert fused_linear >= n_linear  # every linear weight (and gpt's tied head) accumulates in its GEMM


def test_step_accumulates_in_place_over_microbatches(monkeypatch):
    """Local pp=2 step with 4 microbatches: .grad is created once per parameter and then
    accumulated into (never replaced), and the result matches the eager reference."""
    case = make_gpt()
    ref = __import__("copy").deepcopy(case.model)
    ref_loss = case.loss_fn(ref(*case.inputs), case.target)
    ref_loss.backward()
    pm = autopar.parallelize(case.model, case.inputs, loss_fn=case.loss_fn,
                             plan=autopar.Plan(pp=2, schedule="1f1b", num_microbatches=4), example_target=case.target)
    created = {}
    original = execute.run

    def watching(prog, env, state, accumulate=(), into=None, keep=None):
        for k, t in zip(accumulate, into or ()):
            created.setdefault(k, t)
            assert created[k] is t, f"{k}: the accumulator was replaced"
        return original(prog, env, state, accumulate, into, keep)

    monkeypatch.setattr("autopar.runtime.stage_work.run", watching)
    loss = pm.step(case.inputs, case.target)
    torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-5, atol=1e-7)
    assert created, "no program was given accumulators"
    for name, p in case.model.named_parameters():
        torch.testing.assert_close(p.grad, dict(ref.named_parameters())[name].grad, rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"{name}: {m}")


def _alive_probe(probe):
    def check(t):
        probe["alive"] = probe["ref"]() is not None
        return t
    return check


def test_an_argument_handed_over_is_freed_at_its_last_use():
    """Boxed convention: with keep=frozenset() the program holds the env's only reference to
    a saved value, and frees it right after its last use, before the program ends."""
    probe = {}
    g = fx.Graph()
    x, w = g.placeholder("saved_x"), g.placeholder("param_w")
    y = g.call_function(aten.mul.Tensor, (x, w))       # last use of saved_x
    z = g.call_function(_alive_probe(probe), (y,))     # runs after it
    g.output((g.call_function(aten.add.Tensor, (z, 1)),))
    prog = Program(gm=fx.GraphModule(torch.nn.Module(), g), args=("saved:x", "param:w"), results=("r",))
    env = {"saved:x": torch.ones(4)}
    probe["ref"] = __import__("weakref").ref(env["saved:x"])
    state = {"param:w": torch.full((4,), 3.0)}
    execute.run(prog, env, state, keep=frozenset())
    assert probe["alive"] is False and "saved:x" not in env
    assert torch.equal(env["r"], torch.full((4,), 4.0))
    env = {"saved:x": torch.ones(4)}
    probe["ref"] = __import__("weakref").ref(env["saved:x"])
    execute.run(prog, env, state, keep=frozenset({"saved:x"}))  # a later program still reads it: kept
    assert probe["alive"] is True and "saved:x" in env
