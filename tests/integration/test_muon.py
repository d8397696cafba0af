"""Issue 36 U1/U3: ``autopar.Muon`` routed from the graph, against eager ``torch.optim.Muon`` on
the routed matrices plus ``torch.optim.AdamW`` on the rest (tests/reference.EagerMuonAdamW).

Routing (U3) is checked against what each parameter is, written by hand: embeddings (a tied
head included), the LM head, norms, biases, an MoE router, expert biases, fused q/k/v split per
head. The per-head update is checked against ``torch.optim.Muon`` stepping each head's rows as a
matrix of its own. Three steps, loss 1e-5, parameters 1e-4 (U1).
"""
import copy

import pytest
import torch

import autopar
from autopar.muon import MuonAdamW
from autopar.passes import capture
from autopar.passes.optimizer_routing import route_parameters
from tests.models import make_gpt, make_moe_ep
from tests.reference import EagerMuonAdamW, assert_close_state, eager_reference

# float32 Newton-Schulz in both (tests/reference.EagerMuonAdamW says why)
SPEC = autopar.Muon(lr=0.02, adamw_lr=3e-3, ns_dtype=torch.float32)


def _routes(case, split_heads=False):
    return route_parameters(capture(case.model, case.inputs, case.target, case.loss_fn), split_heads=split_heads)


def _kinds(routes):
    return {f: ("muon" if r.muon else r.reason) for f, r in routes.items()}


def test_routing_gpt_tied_head_norms_biases_fused_qkv():
    case = make_gpt()
    kinds = _kinds(_routes(case, split_heads=True))
    assert kinds["wte.weight"] == "embedding"          # tied: also the LM head's weight
    assert kinds["wpe.weight"] == "embedding"
    assert kinds["ln_f.weight"] == kinds["blocks.0.ln1.bias"] == "fewer than 2 dims"
    assert kinds["blocks.0.attn.qkv.bias"] == "fewer than 2 dims"
    hidden = {f for f, k in kinds.items() if k == "muon"}
    mats = ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj")
    assert hidden == {f"blocks.{i}.{m}.weight" for i in range(4) for m in mats}
    routes = _routes(case, split_heads=True)
    # qkv [3 * 4 heads * 8, 32] is cut into heads of 8 rows; the output projection is not
    assert routes["blocks.0.attn.qkv.weight"].rows == 8 and routes["blocks.0.attn.proj.weight"].rows == 0
    assert _routes(case)["blocks.0.attn.qkv.weight"].rows == 0  # split_heads off


def test_routing_hf_llama_head_and_moe_router():
    from tests.hf_models import make_hf

    kinds = _kinds(_routes(make_hf("llama"), split_heads=True))
    assert kinds["lm_head.weight"] == "lm head" and kinds["model.embed_tokens.weight"] == "embedding"
    assert kinds["model.norm.weight"] == "fewer than 2 dims"
    assert {f for f, k in kinds.items() if k == "muon"} == {
        f"model.layers.{i}.{m}.weight" for i in range(2)
        for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                  "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
    kinds = _kinds(_routes(make_moe_ep()))
    assert kinds["layers.0.router.weight"] == "router" and kinds["head.weight"] == "lm head"
    assert kinds["layers.0.experts.w1"] == "muon" and kinds["inp.weight"] == "muon"


def test_routing_gpt_oss_expert_biases_and_override():
    from tests.hf_models import make_hf

    case = make_hf("gpt_oss")
    kinds = _kinds(_routes(case))
    assert kinds["model.layers.0.mlp.router.weight"] == "router"
    assert kinds["model.layers.0.mlp.experts.gate_up_proj_bias"] == "not a matmul operand"
    assert kinds["model.layers.0.mlp.experts.down_proj"] == "muon"
    cap = capture(case.model, case.inputs, case.target, case.loss_fn)
    forced = autopar.Muon(muon_params=["lm_head.*"]).routes(cap)
    assert forced["lm_head.weight"].muon and not forced["model.layers.0.self_attn.q_proj.weight"].muon
    with pytest.raises(ValueError, match="Muon steps matrices"):
        autopar.Muon(muon_params=["*norm*"]).routes(cap)


def test_head_split_update_is_torch_muon_per_head():
    """A [3 heads * 4, 6] matrix stepped with ``muon_rows=4`` equals torch.optim.Muon stepping
    its three [4, 6] row blocks as three matrices."""
    g = torch.Generator().manual_seed(0)
    w = torch.nn.Parameter(torch.randn(12, 6, generator=g))
    blocks = [torch.nn.Parameter(w.detach()[i * 4:(i + 1) * 4].clone()) for i in range(3)]
    ours = MuonAdamW([{"params": [w], "muon": True, "muon_rows": 4}], lr=0.05, weight_decay=0.1)
    ref = torch.optim.Muon(blocks, lr=0.05, weight_decay=0.1)
    for _ in range(3):
        grad = torch.randn(12, 6, generator=g)
        w.grad = grad.clone()
        for i, b in enumerate(blocks):
            b.grad = grad[i * 4:(i + 1) * 4].clone()
        ours.step()
        ref.step()
    torch.testing.assert_close(w.detach(), torch.cat([b.detach() for b in blocks]), rtol=0, atol=1e-6)


def _check_against_eager(case, plan, steps=3, inputs=None, target=None):
    inputs = case.inputs if inputs is None else inputs
    target = case.target if target is None else target
    routes = _routes(case)
    want_losses, want_state = eager_reference(
        copy.deepcopy(case.model), inputs, target, case.loss_fn, EagerMuonAdamW.factory(SPEC),
        num_microbatches=plan.num_microbatches, steps=steps, param_groups=lambda f, p: {"muon": routes[f].muon})
    pm = autopar.parallelize(case.model, inputs, loss_fn=case.loss_fn, optimizer=SPEC, example_target=target,
                             plan=plan)
    for step in range(steps):
        torch.testing.assert_close(pm.step(inputs, target), want_losses[step], rtol=1e-5, atol=0)
    assert_close_state(pm.state_dict(), want_state, rtol=1e-4, atol=1e-5)
    return pm


def test_gpt_local_pp2_matches_eager_muon_adamw():
    pm = _check_against_eager(make_gpt(seed=1), autopar.Plan(pp=2, schedule="zbv", num_microbatches=4))
    text = repr(pm.optimizer)
    assert "blocks.0.attn.qkv.weight" in text and "embedding" in text and "muon" in text
    table = pm.stage_table().splitlines()
    assert table[0].split()[3] == "muon"
    # 4 matrices a block, the 4 blocks over the 4 stages of pp=2 zbv (2 each), none elsewhere
    counts = {int(line.split()[0]): int(line.split()[3]) for line in table[2:]}
    assert sum(counts.values()) == 16, table


def test_hf_llama_dp1_matches_eager_muon_adamw():
    from tests.hf_models import make_hf

    _check_against_eager(make_hf("llama", seed=2), autopar.Plan(num_microbatches=2))


def test_moe_experts_stepped_per_expert_matrix():
    """3-D expert weights: every expert's matrix orthogonalized alone."""
    _check_against_eager(make_moe_ep(seed=3), autopar.Plan(num_microbatches=2))
