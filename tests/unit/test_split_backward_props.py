"""Property tests (hypothesis) for passes/split_backward on random small stacks.

For random MLP / transformer stacks cut into random stage counts, running every stage's F,
then I (last stage first), then W reproduces eager torch.autograd.grad of the loss for every
weight; I holds no work that only weight gradients need and W none that input gradients need;
graph.lint() holds for every produced module.
"""
import copy

import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from autopar.passes import capture, keys, split_backward, split_stages
from autopar.passes.split_backward import _ancestors
from autopar.runtime import LocalPipeline
from autopar.schedules.ir import Action, Schedule


class MLPBlock(nn.Module):
    def __init__(self, d, norm, act):
        super().__init__()
        self.norm = nn.LayerNorm(d) if norm else nn.Identity()
        self.fc1 = nn.Linear(d, 2 * d)
        self.fc2 = nn.Linear(2 * d, d, bias=False)
        self.act = act

    def forward(self, x):
        h = self.fc1(self.norm(x))
        h = {"gelu": F.gelu, "relu": F.relu, "tanh": torch.tanh}[self.act](h)
        return x + self.fc2(h)


class AttnBlock(nn.Module):
    def __init__(self, d, norm, act):
        super().__init__()
        self.norm = nn.LayerNorm(d) if norm else nn.Identity()
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)
        self.mlp = MLPBlock(d, norm, act)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, t, 3, 2, d // 2).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(y.transpose(1, 2).reshape(b, t, d))
        return self.mlp(x)


class Stack(nn.Module):
    def __init__(self, kinds, d, norm, act):
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.layers = nn.ModuleList([(AttnBlock if k == "attn" else MLPBlock)(d, norm, act) for k in kinds])
        self.head = nn.Linear(d, 3)

    def forward(self, x):
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def _sequential_split_schedule(num_stages: int) -> Schedule:
    """One stage per rank, one microbatch: all F, then I from the last stage, then every W."""
    acts = [[Action(s, "F", 0), Action(s, "I", 0), Action(s, "W", 0)] for s in range(num_stages)]
    return Schedule(name="fiw", pp=num_stages, num_stages=num_stages, stage_to_rank=tuple(range(num_stages)),
                    num_microbatches=1, actions=tuple(tuple(a) for a in acts))


@settings(max_examples=10)
@given(kinds=st.lists(st.sampled_from(["mlp", "attn"]), min_size=1, max_size=4),
       d=st.sampled_from([4, 8]), norm=st.booleans(), act=st.sampled_from(["gelu", "relu", "tanh"]),
       stages=st.integers(1, 4), recompute=st.booleans(), seed=st.integers(0, 2**16))
def test_f_then_i_then_w_reproduces_autograd(kinds, d, norm, act, stages, recompute, seed):
    torch.manual_seed(seed)
    model = Stack(kinds, d, norm, act)
    x = torch.randn(2, 5, d)
    y = torch.randn(2, 5, 3)
    loss_fn = F.mse_loss
    ref = copy.deepcopy(model)
    ref_loss = loss_fn(ref(x), y)
    ref_grads = dict(zip([n for n, _ in ref.named_parameters()],
                         torch.autograd.grad(ref_loss, list(ref.parameters()))))

    cap = capture(model, (x,), y, loss_fn)
    n_ops = sum(1 for n in cap.gm.graph.nodes if n.op == "call_function")
    stages = min(stages, n_ops)
    stage_graphs = split_stages(cap, stages)
    programs, requires = [], {}
    for sg in stage_graphs:
        prog = split_backward(sg, requires, recompute=recompute)
        requires = {name: True for name in prog.diff_outputs}
        programs.append(prog)
        for p in (prog.f, prog.i, prog.w, prog.b):
            p.gm.graph.lint()
        _check_regions(prog)

    params = dict(model.named_parameters())
    state = keys.state(params, dict(model.named_buffers()), {})
    pipe = LocalPipeline(programs, _sequential_split_schedule(stages), state, params)
    names = cap.inputs + [cap.target]
    loss = pipe.run([dict(zip(names, (x, y)))], 1.0)
    torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-5, atol=1e-7)
    for name, g in ref_grads.items():
        torch.testing.assert_close(params[name].grad, g, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def _check_regions(prog):
    """Every node of I feeds an input gradient; no node of W feeds one (checked on the joint graph)."""
    joint = prog.joint
    out = next(n for n in joint.graph.nodes if n.op == "output")
    flat = list(out.args[0])
    n_fwd = len(flat) - len(prog.grad_inputs) - len(prog.grad_params)
    gin_nodes = flat[n_fwd: n_fwd + len(prog.grad_inputs)]
    gin_anc = {n.name for n in _ancestors(gin_nodes)}
    regions = {kind: {n.name for n in p.gm.graph.nodes if n.op == "call_function"}
               for kind, p in (("F", prog.f), ("I", prog.i), ("W", prog.w))}
    assert regions["I"] <= gin_anc, regions["I"] - gin_anc
    assert not (regions["W"] & gin_anc), regions["W"] & gin_anc
    if prog.stage.index == 0:
        assert not [n for n in prog.i.gm.graph.nodes if n.op == "call_function"], "stage 0 has no upstream: I is empty"
    if not prog.recompute:
        assert not (regions["W"] & regions["F"]) and not (regions["I"] & regions["F"])


class SwiGLU(nn.Module):
    """A linear, then RMSNorm (its weight) and a SwiGLU MLP with a residual: Llama's MLP half."""

    def __init__(self, d, f):
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.w = nn.Parameter(1 + 0.1 * torch.randn(d))
        self.gate, self.up, self.down = nn.Linear(d, f, bias=False), nn.Linear(d, f, bias=False), nn.Linear(f, d)

    def forward(self, x):
        x = self.inp(x)
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.w
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


def _swiglu_stage(d: int, f: int):
    """A seeded SwiGLU model, its data, autograd's loss and gradients on a copy, and its one stage."""
    torch.manual_seed(0)
    model = SwiGLU(d, f)
    x, y = torch.randn(2, 3, d), torch.randn(2, 3, d)
    ref = copy.deepcopy(model)
    ref_loss = F.mse_loss(ref(x), y)
    ref_grads = dict(zip([n for n, _ in ref.named_parameters()], torch.autograd.grad(ref_loss, list(ref.parameters()))))
    cap = capture(model, (x,), y, F.mse_loss)
    (sg,) = split_stages(cap, 1)
    return model, cap, sg, (x, y), ref_loss, ref_grads


def _assert_trains_like_autograd(prog, model, cap, data, ref_loss, ref_grads):
    """One local run of ``prog`` gives autograd's loss and parameter gradients."""
    params = dict(model.named_parameters())
    state = keys.state(params, dict(model.named_buffers()), {})
    pipe = LocalPipeline([prog], _sequential_split_schedule(1), state, params)
    loss = pipe.run([dict(zip(cap.inputs + [cap.target], data))], 1.0)
    torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-6, atol=0)
    for name, g in ref_grads.items():
        torch.testing.assert_close(params[name].grad, g, rtol=1e-6, atol=1e-7, msg=lambda m: f"{name}: {m}")


def test_element_wise_values_are_made_again_in_the_backward():
    """What F keeps for the backward, by hand: the weight gradients need the norm's output h
    (and its input times the rsqrt, for the norm's weight) and silu(gate) * up; the input
    gradients need gate, up, the norm's input x and its rsqrt. Element-wise ops make h from x
    and the rsqrt, silu(gate) * up from gate and up: F keeps x [N, d], the rsqrt [N, 1], gate
    and up [N, f], and the model output, which the loss's gradient reads, and nothing else (the
    model input, which the first linear's weight gradient reads, is data); F, I, W still give
    autograd's gradients."""
    d, f = 4, 12
    model, cap, sg, data, ref_loss, ref_grads = _swiglu_stage(d, f)
    prog = split_backward(sg, {})
    out = next(v for v in prog.f.gm.graph.nodes if v.op == "output").args[0]
    saved = sorted(tuple(v.meta["val"].shape) for k, v in zip(prog.f.results, out)
                   if keys.is_kind(k, keys.SAVED) and v.meta["val"].dim() == 3)  # (not the weights' views)
    assert saved == [(2, 3, 1), (2, 3, d), (2, 3, d), (2, 3, f), (2, 3, f)], saved
    _check_regions(prog)
    _assert_trains_like_autograd(prog, model, cap, data, ref_loss, ref_grads)


def test_without_remaking_f_keeps_the_element_wise_values():
    """``remake=False`` (``Plan.remake`` off: the eager default): F keeps what the backward reads
    as the forward made it. Beyond the remade case, by hand: the norm's x * rsqrt [N, d] (the
    norm weight's gradient), its output h for the gate's and the up projection's weight
    gradients (two [N, d] views, one per linear), silu(gate) and silu(gate) * up [N, f]:
    4 bytes x N x (3 d + 2 f) more, and the backward makes none of them again; the gradients
    are autograd's either way."""
    d, f = 4, 12
    model, cap, sg, data, ref_loss, ref_grads = _swiglu_stage(d, f)
    remade, kept = split_backward(sg, {}, remake=True), split_backward(sg, {}, remake=False)
    assert (remade.remake, kept.remake) == (True, False)
    assert kept.saved_bytes - remade.saved_bytes == 4 * 6 * (3 * d + 2 * f)

    def elementwise(prog):
        return sum(1 for p in (prog.i, prog.w) for n in p.gm.graph.nodes
                   if n.op == "call_function" and n.target in (torch.ops.aten.silu.default, torch.ops.aten.mul.Tensor))

    assert elementwise(kept) < elementwise(remade)
    _check_regions(kept)
    _assert_trains_like_autograd(kept, model, cap, data, ref_loss, ref_grads)
