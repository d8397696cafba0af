"""Experts folded over the tensor-parallel ranks: which plans are valid, which ranks share a
stage's experts (hand-derived from the rank layout global = (replica * pp + pp_rank) * tp + t),
and the blocks that cannot fold. The 4-process runs are tests/dist/test_folded_experts.py."""
import pytest
import torch.nn as nn

import autopar
from autopar.runtime.mesh import Mesh, check_degrees


def test_plans_fold_ep_over_tp_and_name_the_product():
    autopar.Plan(dp=2, tp=2, ep=4)  # 4 expert ranks over 2 replicas x 2 tp ranks
    autopar.Plan(pp=2, tp=2, ep=2)  # ep=2 over dp*cp = 1: the tp ranks
    with pytest.raises(ValueError, match=r"ep=4 must divide dp\*cp = 2\*1 = 2"):
        autopar.Plan(dp=2, ep=4)
    with pytest.raises(ValueError, match=r"ep=8 must divide dp\*cp\*tp = 2\*1\*2 = 4"):
        autopar.Plan(dp=2, tp=2, ep=8)
    with pytest.raises(ValueError, match=r"ep=8 must divide dp\*cp\*tp = 2\*1\*2 = 4"):
        check_degrees(1, 2, 1, 8, 4, tp=2)


@pytest.mark.parametrize("pp, dp, tp, ep, want, copies, folded", [
    # (ep rank, expert-data-parallel index) of every global rank; ranks holding the same experts
    (1, 2, 2, 4, [(0, 0), (1, 0), (2, 0), (3, 0)], 1, True),     # one ep group: all 4 ranks
    (1, 2, 2, 2, [(0, 0), (1, 0), (0, 1), (1, 1)], 2, True),     # each replica's tp ranks
    (2, 1, 2, 2, [(0, 0), (1, 0), (0, 0), (1, 0)], 1, True),     # per stage: its 2 tp ranks
    (1, 4, 1, 2, [(0, 0), (1, 0), (0, 1), (1, 1)], 2, False),    # no tp: replicas, as before
    (1, 2, 2, 1, [(0, 0), (0, 0), (0, 1), (0, 1)], 2, False),    # ep=1: not folded, replicas
])
def test_expert_ranks_of_a_folded_mesh(pp, dp, tp, ep, want, copies, folded):
    meshes = [Mesh(pp=pp, dp=dp, tp=tp, ep=ep, rank=r) for r in range(pp * dp * tp)]
    assert [(m.ep_rank, m.expert_replica) for m in meshes] == want
    assert {m.folded for m in meshes} == {folded}
    assert {m.expert_replicas for m in meshes} == {copies}


def test_static_capacity_blocks_refuse_to_fold():
    from autopar.passes.expert_parallel import apply_expert_parallel

    model = nn.Sequential(autopar.nn.MoE(8, 16, 4, 2, capacity_factor=1.0))
    with pytest.raises(ValueError, match="static capacity"):
        apply_expert_parallel(model, 2, 0, None, fold_group=None, fold=2)


@pytest.mark.parametrize("capacity_factor", [None, 1.0])
def test_planner_folds_only_dropless_experts(capacity_factor, monkeypatch):
    """The search enumerates ep up to dp x cp x tp where the experts can fold (dropless), and
    keeps ep = 1 beside tp > 1 for a static-capacity MoE (it refuses to fold at build)."""
    from autopar.examples.llama import LlamaConfig, make_llama
    from autopar.planner import profile, search
    from autopar.planner.profile import profile_model
    from autopar.planner.request import Request

    monkeypatch.setattr(profile, "TP_EFFICIENCY", 0.0)  # the tiny model: search tp whatever it saves
    cfg = LlamaConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2, n_kv_heads=2, ffn_hidden=64, seq_len=16,
                      n_experts=4, top_k=2, expert_hidden=48, capacity_factor=capacity_factor)
    model, inputs, target, loss_fn = make_llama(cfg, batch_size=8)
    prof = profile_model(model, inputs, target, loss_fn, expert_prefixes=(".experts.",), n_experts=4)
    lays = list(search.layouts(prof, Request(gpus=4, global_batch=8, memory_limit=80e9), lambda lay, why: None,
                               max_tp=4))
    assert {lay.ep for lay in lays if lay.tp == 1} == {1, 2, 4}
    with_tp = {(lay.tp, lay.dp, lay.ep) for lay in lays if lay.tp > 1}
    if capacity_factor is None:
        assert with_tp >= {(2, 2, 4), (2, 1, 2), (4, 1, 4)}, sorted(with_tp)
    else:
        assert with_tp and {ep for _tp, _dp, ep in with_tp} == {1}, sorted(with_tp)
