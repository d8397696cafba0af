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


@pytest.mark.parametrize("pp, dp, tp, ep, want", [
    # (ep rank, expert-data-parallel index) of every global rank
    (1, 2, 2, 4, [(0, 0), (1, 0), (2, 0), (3, 0)]),                 # one ep group: all 4 ranks
    (1, 2, 2, 2, [(0, 0), (1, 0), (0, 1), (1, 1)]),                 # each replica's tp ranks; 2 copies
    (2, 1, 2, 2, [(0, 0), (1, 0), (0, 0), (1, 0)]),                 # per stage: its 2 tp ranks
    (1, 4, 1, 2, [(0, 0), (1, 0), (0, 1), (1, 1)]),                 # no tp: replicas, as before
    (1, 2, 2, 1, [(0, 0), (0, 0), (0, 1), (0, 1)]),                 # ep=1: not folded, replicas
])
def test_expert_ranks_of_a_folded_mesh(pp, dp, tp, ep, want):
    meshes = [Mesh(pp=pp, dp=dp, tp=tp, ep=ep, rank=r) for r in range(pp * dp * tp)]
    assert [(m.ep_rank, m.expert_replica) for m in meshes] == want
    assert all(m.folded == (tp > 1 and ep > 1) for m in meshes)
    copies = dp * (tp if ep > 1 else 1) // ep
    assert {m.expert_replicas for m in meshes} == {copies}


def test_static_capacity_blocks_refuse_to_fold():
    from autopar.passes.expert_parallel import apply_expert_parallel

    model = nn.Sequential(autopar.nn.MoE(8, 16, 4, 2, capacity_factor=1.0))
    with pytest.raises(ValueError, match="static capacity"):
        apply_expert_parallel(model, 2, 0, None, fold_group=None, fold=2)
