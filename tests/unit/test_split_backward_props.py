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
