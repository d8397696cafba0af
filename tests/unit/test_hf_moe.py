"""Single process: which MoE blocks expert parallelism shards (``moe_blocks``) and which it
refuses (named, with what it expected, before any process group is touched); ep=1 changes
nothing; capture's differentiable ``aten.copy`` (DeepSeek-V3's MLA writes into slices of a
fresh buffer) gives the eager gradients. The ep=2 numerics are in tests/dist/test_hf_expert_parallel.py."""
import copy
import functools

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
