"""Single process: which MoE blocks expert parallelism shards (``moe_blocks``) and which it
refuses (named, with what it expected, before any process group is touched), for
transformers experts modules and for experts modules of other forms (their own forward run on
each rank's experts: ``run_local_experts``); ep=1 changes nothing; capture's differentiable
``aten.copy`` (DeepSeek-V3's MLA writes into slices of a fresh buffer) gives the eager
gradients. The ep=2 numerics are in tests/dist/test_hf_expert_parallel.py."""
import copy
import functools
import re

import pytest
import torch
import torch.nn as nn

from autopar.passes.expert_parallel import (
    apply_expert_parallel,
    check_expert_parallel,
    expert_parameters,
    moe_blocks,
    refused_moe_blocks,
)
from tests.hf_models import build_hf


@pytest.fixture(scope="module")
def hf():
    return {name: build_hf(name) for name in ("mixtral", "qwen3_moe", "deepseek_v3", "llama")}


class _SparseMoeBlock(nn.Module):  # transformers 4.x Mixtral layout: one module per expert
    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(8, 4, bias=False)
        self.experts = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))


def test_moe_blocks_lists_fqn_and_expert_count(hf):
    from autopar.nn import MoE

    assert moe_blocks(hf["mixtral"]) == [("model.layers.0.mlp", 4), ("model.layers.1.mlp", 4)]
    assert moe_blocks(hf["qwen3_moe"]) == [("model.layers.0.mlp", 4), ("model.layers.1.mlp", 4)]
    assert moe_blocks(hf["deepseek_v3"]) == [("model.layers.1.mlp", 4)]  # layer 0 is dense
    assert moe_blocks(hf["llama"]) == []
    mixed = nn.Sequential(nn.Linear(8, 8), MoE(8, 16, 6, 2), nn.Sequential(MoE(8, 16, 4, 1)))
    assert moe_blocks(mixed) == [("1", 6), ("2.0", 4)]
    assert moe_blocks(MoE(8, 16, 2, 1)) == [("", 2)]  # the root
    for model in (hf["mixtral"], hf["deepseek_v3"], mixed):
        assert refused_moe_blocks(model) == []
    # exactly what apply_expert_parallel shards: not DeepSeek's shared_experts, not the routers
    assert expert_parameters(hf["deepseek_v3"]) == ["model.layers.1.mlp.experts.gate_up_proj",
                                                    "model.layers.1.mlp.experts.down_proj"]
    assert expert_parameters(mixed) == ["1.experts.w1", "1.experts.w3", "1.experts.w2",
                                        "2.0.experts.w1", "2.0.experts.w3", "2.0.experts.w2"]
    assert set(expert_parameters(hf["deepseek_v3"])) == set(apply_expert_parallel(copy.deepcopy(hf["deepseek_v3"]),
                                                                                  1, 0, None))


def test_ep1_on_hf_shards_nothing_and_keeps_numbers(hf):
    model = copy.deepcopy(hf["deepseek_v3"])
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    want = hf["deepseek_v3"](ids).logits
    shards = apply_expert_parallel(model, 1, 0, None)
    assert {f: s.full_shape for f, s in shards.items()} == {
        "model.layers.1.mlp.experts.gate_up_proj": (4, 64, 32), "model.layers.1.mlp.experts.down_proj": (4, 32, 32)}
    assert type(model.model.layers[1].mlp.experts) is type(hf["deepseek_v3"].model.layers[1].mlp.experts)
    assert torch.equal(model(ids).logits, want)


def test_unrecognized_blocks_are_refused_by_name_before_any_group():
    """No process group exists here: reaching the group lookup would raise another error."""
    from autopar.nn import MoE

    model = nn.Sequential(MoE(8, 8, 4, 2), _SparseMoeBlock())
    assert refused_moe_blocks(model) == [("1", "_SparseMoeBlock: 1.experts is a ModuleList (separate expert "
                                          "modules, routed with data-dependent shapes)")]
    with pytest.raises(ValueError, match=r"does not support the MoE block\(s\) \['1'\] \(_SparseMoeBlock\): "
                                         r"1 \(_SparseMoeBlock\): 1.experts is a ModuleList.*Expected autopar.nn.MoE.*"
                                         r"@use_experts_implementation"):
        apply_expert_parallel(model, 2, 0, None)
    assert model[0].experts.w1.shape[0] == 4  # nothing changed


def test_hf_experts_with_a_dynamic_implementation_are_refused(hf):
    model = copy.deepcopy(hf["mixtral"])
    model.set_experts_implementation("eager")  # loops over nonzero(): no static graph holds it
    refused = refused_moe_blocks(model)
    assert [name for name, _why in refused] == ["model.layers.0.mlp", "model.layers.1.mlp"]
    assert "experts_implementation is 'eager'" in refused[0][1]
    with pytest.raises(ValueError, match=r"\['model.layers.0.mlp', 'model.layers.1.mlp'\] \(MixtralSparseMoeBlock\)"
                                         r".*set_experts_implementation\('grouped_mm'\)"):
        check_expert_parallel(model, 2)
    with pytest.raises(ValueError, match="does not support the MoE block"):
        apply_expert_parallel(model, 2, 0, None)
    assert model.model.layers[0].mlp.experts.gate_up_proj.shape[0] == 4


def test_expert_count_must_divide_and_a_model_needs_a_block(hf):
    with pytest.raises(ValueError, match=r"model.layers.0.mlp has n_experts=4, not divisible by ep=3.*\[1, 2, 4\]"):
        check_expert_parallel(hf["mixtral"], 3)
    with pytest.raises(ValueError, match=r"LlamaForCausalLM has no MoE block expert parallelism can shard"):
        check_expert_parallel(hf["llama"], 2)
    with pytest.raises(ValueError, match="needs an initialized process group"):  # all checks passed, then the group
        apply_expert_parallel(copy.deepcopy(hf["qwen3_moe"]), 2, 1, None)


# -- experts modules of other forms (passes/hf_moe.py: generic_refusal, run_local_experts) ------------------------


def _custom_mixtral():
    """tests/dist's tiny Mixtral whose experts a user replaced (LoopExperts, GatherExperts)."""
    from tests.dist.test_hf_expert_parallel import custom_experts

    return custom_experts(build_hf("mixtral"))


def test_experts_of_other_forms_are_sharded_like_hf_ones(hf):
    from autopar.passes import hf_moe

    model = _custom_mixtral()
    assert moe_blocks(model) == [("model.layers.0.mlp", 4), ("model.layers.1.mlp", 4)]
    assert refused_moe_blocks(model) == []
    # every parameter of the experts module, its child's included; not the router. Layer 1's block
    # calls them bank and scorer (tests/dist/test_hf_expert_parallel.ScoredBank): found all the same
    params = expert_parameters(model)
    assert params == ([f"model.layers.0.mlp.experts.{p}" for p in ("w_gate", "w_up", "w_down", "out_scale", "out_bias")]
                      + [f"model.layers.1.mlp.bank.{p}" for p in ("gate_up", "down", "post.scale", "post.shift")])
    check_expert_parallel(model, 2)
    check_expert_parallel(model, 4)
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    want = model(ids).logits
    ep1 = copy.deepcopy(model)
    assert set(apply_expert_parallel(ep1, 1, 0, None)) == set(params)
    assert type(ep1.model.layers[1].mlp.bank) is type(model.model.layers[1].mlp.bank)
    assert torch.equal(ep1(ids).logits, want)

    # a transformers experts class whose forward a user overrode is not the transformers code:
    # the generic form (its own forward, its extra per-expert bias)
    class BiasedExperts(type(hf["mixtral"].model.layers[0].mlp.experts)):
        def __init__(self, config):
            super().__init__(config)
            self.out_bias = nn.Parameter(torch.zeros(self.num_experts, config.hidden_size))

        def forward(self, hidden_states, top_k_index, top_k_weights):
            out = super().forward(hidden_states, top_k_index, top_k_weights)
            return out + (top_k_weights.unsqueeze(-1) * self.out_bias[top_k_index]).sum(1)

    sub = copy.deepcopy(hf["mixtral"])
    sub.model.layers[1].mlp.experts = BiasedExperts(sub.config)
    assert not hf_moe.is_hf_experts(sub.model.layers[1].mlp.experts)
    assert hf_moe.is_hf_experts(sub.model.layers[0].mlp.experts)
    assert moe_blocks(sub) == [("model.layers.0.mlp", 4), ("model.layers.1.mlp", 4)]
    assert expert_parameters(sub)[-3:] == [f"model.layers.1.mlp.experts.{p}" for p in
                                           ("gate_up_proj", "down_proj", "out_bias")]
    check_expert_parallel(sub, 2)


def test_run_local_experts_on_each_rank_sums_to_the_module():
    """The local step alone, ep=2 without a process group: each rank's module (rewritten in
    place: its parameters sliced) runs its own forward on the rows routed to it, padding rows
    (token 0, local id 0, weight 0) give exact zeros, and each token's k slot results sum to
    the unsharded module's output; the gradients too."""
    from autopar.passes import hf_moe
    from tests.dist.test_hf_expert_parallel import GatherExperts, LoopExperts

    g = torch.Generator().manual_seed(0)
    n, k, d, n_experts, ep = 5, 2, 8, 4, 2
    x = torch.randn(n, d, generator=g)
    idx = torch.stack([torch.randperm(n_experts, generator=g)[:k] for _ in range(n)])
    w = torch.rand(n, k, generator=g)
    for cls in (LoopExperts, GatherExperts):
        full = cls(n_experts, d, 6)
        with torch.no_grad():
            for p in full.parameters():
                p.copy_(torch.randn(p.shape, generator=g))
        ranks = [copy.deepcopy(full) for _ in range(ep)]
        for r, m in enumerate(ranks):
            shards = hf_moe.apply_generic_expert_parallel(m, "experts.", ep, r, None)
            assert [f for f, _s in shards] == [f"experts.{p}" for p, _t in full.named_parameters()]
            assert all(p.shape[0] == n_experts // ep for p in m.parameters())
            assert hf_moe.expert_count(m) == n_experts
        want = full(x, idx, w)
        slot_sum = torch.zeros(n, d)
        for r, m in enumerate(ranks):
            mine = (idx // 2 == r).nonzero()  # (token, choice) pairs on rank r
            rows = torch.cat([x[mine[:, 0]], x[:1]])  # + one padding row
            local = torch.cat([idx[mine[:, 0], mine[:, 1]] - r * 2, torch.zeros(1, dtype=torch.long)])
            weights = torch.cat([w[mine[:, 0], mine[:, 1]], torch.zeros(1)])
            out = hf_moe.run_local_experts(m, rows, local, weights)
            assert torch.equal(out[-1], torch.zeros(d)), cls  # padding contributes exactly nothing
            slot_sum = slot_sum.index_add(0, mine[:, 0], out[:-1])
        torch.testing.assert_close(slot_sum, want, rtol=1e-5, atol=1e-6)
        # gradients: rank r's local parameters get the rows of its experts of the full gradient
        grad = torch.randn(n, d, generator=g)
        torch.autograd.backward(want, grad)
        torch.autograd.backward(slot_sum, grad)
        for r, m in enumerate(ranks):
            for (name, p), (_n, q) in zip(full.named_parameters(), m.named_parameters()):
                torch.testing.assert_close(q.grad, p.grad[r * 2:(r + 1) * 2], rtol=1e-5, atol=1e-6, msg=name)


class _Experts(nn.Module):
    """A minimal experts module that keeps the contract (the refusal cases below break it)."""

    def __init__(self, n_experts=4, d=8):
        super().__init__()
        self.num_experts = n_experts
        self.w = nn.Parameter(torch.randn(n_experts, d, d))

    def forward(self, hidden_states, top_k_index, top_k_weights):
        y = torch.einsum("nd,nkod->nko", hidden_states, self.w[top_k_index])
        return (top_k_weights.unsqueeze(-1) * y).sum(1)


class _SharedParam(_Experts):
    def __init__(self):
        super().__init__()
        self.norm = nn.Parameter(torch.ones(8))


class _TwoArgs(_Experts):
    def forward(self, hidden_states, routing):
        return super().forward(hidden_states, *routing)


class _VarArgs(_Experts):
    def forward(self, hidden_states, *routing):
        return super().forward(hidden_states, *routing)


class _Nonzero(_Experts):  # the loop of transformers' "eager" experts
    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        for e in range(self.num_experts):
            token, choice = torch.where(top_k_index == e)
            y = hidden_states[token] @ self.w[e].T * top_k_weights[token, choice, None]
            out = out.index_add(0, token, y)
        return out


class _HostRead(_Experts):
    def forward(self, hidden_states, top_k_index, top_k_weights):
        if (top_k_weights == 0).all():  # a shortcut on the values
            return torch.zeros_like(hidden_states)
        return super().forward(hidden_states, top_k_index, top_k_weights)


class _PerExpertBuffer(_Experts):
    def __init__(self):
        super().__init__()
        self.register_buffer("usage", torch.zeros(4))


class _WrongOutput(_Experts):
    def forward(self, hidden_states, top_k_index, top_k_weights):
        return torch.einsum("nd,nkod->nko", hidden_states, self.w[top_k_index])  # the k terms, not their sum


class _HardCodedCount(_Experts):
    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        for e in range(4):  # not self.num_experts: the rank's 2 local experts have no w[2]
            weight = (top_k_weights * (top_k_index == e)).sum(-1, keepdim=True)
            out = out + weight * (hidden_states @ self.w[e].T)
        return out


class _Block(nn.Module):
    def __init__(self, experts):
        super().__init__()
        self.gate = nn.Linear(8, 4, bias=False)
        self.experts = experts


_REFUSED = [
    (_SharedParam, r"parameter norm has shape \(8,\), expected the 4 experts \(num_experts=4\) on dim 0"),
    (_TwoArgs, r"its forward takes \(hidden_states, routing\), expected exactly three positional tensors"),
    (_VarArgs, r"its forward takes \(hidden_states, \*routing\), expected exactly three positional tensors"),
    (_Nonzero, r"its forward has a data-dependent shape \(aten.nonzero.default.*one-hot mask"),
    (_HostRead, r"its forward reads tensor values on the host \(aten._local_scalar_dense.default"),
    (_PerExpertBuffer, r"buffer usage \(4,\) looks per-expert.*nn.Parameter\(requires_grad=False\)"),
    (_WrongOutput, r"its forward returns \(3, 1, 8\) for hidden_states \[3, 8\], expected one tensor \[3, 8\]"),
]


@pytest.mark.parametrize("experts, why", _REFUSED, ids=[cls.__name__.strip("_") for cls, _w in _REFUSED])
def test_experts_breaking_the_contract_are_refused_by_name(experts, why):
    """Named with the experts FQN and what broke, before any process group (none exists)."""
    model = nn.Sequential(_Block(_Experts()), _Block(experts()))
    assert moe_blocks(model) == [("0", 4)]
    refused = refused_moe_blocks(model)
    assert [name for name, _w in refused] == ["1"]
    assert re.match(rf"_Block: 1.experts \({experts.__name__}\): {why}", refused[0][1]), refused[0][1]
    with pytest.raises(ValueError, match=rf"does not support the MoE block\(s\) \['1'\].*1.experts.*{why}"):
        apply_expert_parallel(model, 2, 0, None)
    assert model[0].experts.w.shape[0] == 4 and type(model[0].experts) is _Experts  # nothing changed


class _Renamed(_Experts):
    """GPT-OSS's call form: other names, defaults, passed by keyword by its block."""

    def forward(self, x, router_indices=None, routing_weights=None):
        return super().forward(x, router_indices, routing_weights)


def test_experts_are_recognized_by_contract_not_by_argument_names():
    """Any names, positional or keyword: the three inputs are taken by position of the forward's
    parameters and checked by shape and dtype (rows floating, ids integer, weights floating)."""
    from autopar.passes import hf_moe

    model = nn.Sequential(_Block(_Renamed()))
    assert moe_blocks(model) == [("0", 4)] and refused_moe_blocks(model) == []
    m = model[0].experts
    x, idx, w = torch.randn(3, 8), torch.tensor([[0, 1], [2, 3], [1, 2]]), torch.rand(3, 2)
    for args, kwargs in (((x, idx, w), {}), ((x,), {"routing_weights": w, "router_indices": idx})):
        got = hf_moe._call_args(m, args, kwargs)
        assert all(a is b for a, b in zip(got, (x, idx, w)))
    with pytest.raises(ValueError, match=r"\(rows \[N, d\] floating, expert ids \[N, k\] integer.*\(3, 2\) "
                                         r"torch.float32, \(3, 2\) torch.float32"):
        hf_moe._call_args(m, (x, idx.float(), w), {})


def test_code_that_needs_all_experts_is_refused_at_its_ep_degree():
    """The forward is probed with E / ep local experts once ep is known: ``range(4)`` over 2."""
    model = nn.Sequential(_Block(_HardCodedCount()))
    assert moe_blocks(model) == [("0", 4)] and refused_moe_blocks(model) == []
    check_expert_parallel(model, 1)
    with pytest.raises(ValueError, match=r"MoE block 0 at ep=2: 0.experts \(_HardCodedCount\) with its 2 local "
                                         r"experts: its forward fails on .* with 2 experts: IndexError"):
        apply_expert_parallel(model, 2, 0, None)
    assert model[0].experts.w.shape[0] == 4 and model[0].experts.num_experts == 4  # probe left it as it was


class _SliceWrites(nn.Module):
    """Writes into slices of a fresh buffer, as DeepSeek-V3's MLA ``expand_kv`` does: after
    functionalization that is ``aten.copy`` + ``slice_scatter``."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 3)
        self.b = nn.Linear(4, 5)
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        out = x.new_empty(*x.shape[:-1], 8)
        out[..., :3] = self.a(x)
        out[..., 3:] = self.b(x)[..., :1].expand(*x.shape[:-1], 5) + self.b(x)
        return self.head(torch.tanh(out))


def test_capture_differentiates_slice_writes():
    import autopar
    from autopar.passes import capture
    from tests.reference import assert_close_state, eager_reference

    torch.manual_seed(0)
    model, x, y = _SliceWrites(), torch.randn(4, 6, 4), torch.randn(4, 6, 2)
    loss_fn = nn.functional.mse_loss
    captured = capture(model, (x[:2],), y[:2], loss_fn)
    assert not [n for n in captured.gm.graph.nodes if n.target is torch.ops.aten.copy.default], "aten.copy left"
    opt = functools.partial(torch.optim.SGD, lr=0.5)
    ref_losses, ref_state = eager_reference(model, (x,), y, loss_fn, opt, num_microbatches=2, steps=2)
    pm = autopar.parallelize(model, (x,), loss_fn=loss_fn, optimizer=opt, example_target=y,
                             plan=autopar.Plan(pp=2, schedule="1f1b", num_microbatches=2))
    losses = [pm.step((x,), y) for _ in range(2)]
    for got, want in zip(losses, ref_losses):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
    assert_close_state(pm.state_dict(), ref_state)


class _Grouped(nn.Module):
    """Experts given rows grouped by expert (Llama 4's form): ``[E * C, d]`` viewed as ``[E, C, d]``
    against ``[E, ...]`` weights, the expert count read off the weights."""

    def __init__(self, n_experts=4, d=8):
        super().__init__()
        self.num_experts = n_experts
        self.w = nn.Parameter(torch.randn(n_experts, d, d))
        self.b = nn.Parameter(torch.randn(n_experts, 1, d))

    def forward(self, hidden_states):
        x = hidden_states.view(self.w.shape[0], -1, hidden_states.shape[-1])
        return (torch.tanh(torch.bmm(x, self.w)) + self.b).reshape(-1, x.shape[-1])


class _GroupedFixedCount(_Grouped):
    def forward(self, hidden_states):
        x = hidden_states.view(4, -1, hidden_states.shape[-1])  # all 4 experts, whatever this rank holds
        return torch.bmm(x, self.w).reshape(-1, x.shape[-1])


class _GroupedSummed(_Grouped):
    def forward(self, hidden_states):
        return super().forward(hidden_states).view(self.w.shape[0], -1, 8).sum(0)  # the experts' sum, not per row


class _GroupedSharedParam(_Grouped):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(8))


_GROUPED_REFUSED = [
    (_GroupedSharedParam, r"parameter scale has shape \(8,\), expected the 4 experts \(num_experts=4\) on dim 0"),
    (_GroupedSummed, r"its forward returns \(3, 8\) for rows grouped by expert \[12, 8\], expected one tensor of "
                     r"12 rows in the same expert order"),
]


@pytest.mark.parametrize("experts, why", _GROUPED_REFUSED, ids=["shared-param", "summed-output"])
def test_grouped_experts_breaking_the_contract_are_refused_by_name(experts, why):
    """Rows grouped by expert (one positional tensor): the same parameter rules as the other
    forms, and the forward must give one row per row it got, with E / ep experts."""
    model = nn.Sequential(_Block(_Grouped()), _Block(experts()))
    assert moe_blocks(model) == [("0", 4)]
    refused = refused_moe_blocks(model)
    assert [name for name, _w in refused] == ["1"] and re.search(why, refused[0][1]), refused
    fixed = nn.Sequential(_Block(_GroupedFixedCount()))
    assert refused_moe_blocks(fixed) == []  # with all 4 experts it keeps the form
    with pytest.raises(ValueError, match=r"MoE block 0 at ep=2: 0.experts \(_GroupedFixedCount\) with its 2 local "
                                         r"experts: its forward fails on rows grouped by expert \[6, 8\]"):
        apply_expert_parallel(fixed, 2, 0, None)


def test_grouped_experts_local_step_matches_the_module():
    """ep=2 without a process group: each rank's module (parameters sliced in place, its expert
    count attribute E / ep) run on its experts' groups of the [E * C, d] rows gives exactly
    those rows of the unsharded module's output, and its parameters those rows of the gradients;
    Llama 4's experts (transformers' Llama4TextExperts) are recognized as this form."""
    from autopar.passes import grouped_experts, hf_moe

    g = torch.Generator().manual_seed(0)
    n_experts, cap, d, ep = 4, 3, 8, 2
    full = _Grouped(n_experts, d)
    x = torch.randn(n_experts * cap, d, generator=g)
    want = full(x)
    grad = torch.randn_like(want)
    want.backward(grad)
    for r in range(ep):
        m = copy.deepcopy(full)
        m.zero_grad()
        shards = grouped_experts.apply_grouped_expert_parallel(m, "experts.", ep, r, None)
        assert shards == [("experts.w", (4, d, d)), ("experts.b", (4, 1, d))]
        assert m.w.shape[0] == 2 and m.num_experts == 2 and hf_moe.expert_count(m) == n_experts
        rows = slice(r * 2 * cap, (r + 1) * 2 * cap)
        out = hf_moe._first_forward(type(m))(m, x[rows])  # the module's own code on its experts' rows
        torch.testing.assert_close(out, want[rows].detach(), rtol=1e-6, atol=1e-6)
        out.backward(grad[rows])
        torch.testing.assert_close(m.w.grad, full.w.grad[r * 2:(r + 1) * 2], rtol=1e-5, atol=1e-6)
    llama4 = build_hf("llama4")
    assert moe_blocks(llama4) == [("model.layers.0.feed_forward", 4), ("model.layers.1.feed_forward", 4)]
    assert refused_moe_blocks(llama4) == []
    assert grouped_experts.is_grouped(llama4.model.layers[0].feed_forward.experts)


def test_grouped_expert_parallel_keeps_both_layouts_and_widths():
    """The expert-parallel forward on a fake 2-rank group (shapes only: a fake group moves no
    data): rows [E * C, d] and stacked [E, C, d] come back in the layout the module returns, at
    its output width, for the global E experts; a module returning another row count is named."""
    import torch.distributed as dist
    from torch.distributed._functional_collectives import _resolve_group_name
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from autopar.passes import grouped_experts

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")

    class Widening(nn.Module):  # d = 8 in, 6 out; stacked in, stacked out
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(4, 8, 6))

        def forward(self, x):
            if x.dim() == 3:
                return torch.bmm(x, self.w)
            return torch.bmm(x.view(self.w.shape[0], -1, x.shape[-1]), self.w).reshape(-1, 6)

    class Dropping(Widening):
        def forward(self, x):
            return super().forward(x)[:1]

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        group = _resolve_group_name(dist.group.WORLD)
        m = Widening()
        grouped_experts.apply_grouped_expert_parallel(m, "experts.", 2, 0, group)
        assert m.w.shape == (2, 8, 6)
        assert m(torch.randn(12, 8)).shape == (12, 6) and m(torch.randn(4, 3, 8)).shape == (4, 3, 6)
        bad = Dropping()
        grouped_experts.apply_grouped_expert_parallel(bad, "experts.", 2, 0, group)
        with pytest.raises(ValueError, match=r"returned \(1, 6\) for rows \(12, 8\) of its 2 experts"):
            bad(torch.randn(12, 8))
        with pytest.raises(ValueError, match=r"got rows \(10, 8\): expected them grouped by its 4 experts"):
            m(torch.randn(10, 8))
    finally:
        dist.destroy_process_group()
