"""Plan is data that round-trips: ``Plan.from_json(plan.to_json())`` keeps every field, and the
JSON ``autopar plan --json`` prints, fed back, gives the plan the planner chose."""
import json
from dataclasses import fields

import pytest
import torch

import autopar


def test_every_field_round_trips():
    plan = autopar.Plan(pp=2, dp=2, cp=1, ep=1, schedule="zb-h1", num_microbatches=4, stages_per_rank=1,
                        stage_cuts=(17,), recompute=(1,), zero=2, loss_chunk_tokens=512, offload=(0.5, 0.0), tp=2,
                        sequence_parallel=True, compile=True, remake=(1,))
    back = autopar.Plan.from_json(plan.to_json())
    assert back == plan
    assert {f.name for f in fields(autopar.Plan)} <= set(json.loads(plan.to_json()))
    with pytest.raises(ValueError, match="sequence_parallel=True needs tp > 1"):
        autopar.Plan(sequence_parallel=True)


def test_remake_names_stages_and_defaults_to_compile():
    """``Plan.remake``: None follows ``compile``; True / False every stage / none; a tuple those
    stages; a stage outside the plan is an error naming the stage count."""
    assert [autopar.Plan(pp=2).remakes(s) for s in (0, 1)] == [False, False]
    assert [autopar.Plan(pp=2, compile=True).remakes(s) for s in (0, 1)] == [True, True]
    assert [autopar.Plan(pp=2, compile=True, remake=False).remakes(s) for s in (0, 1)] == [False, False]
    assert [autopar.Plan(pp=2, remake=[1, 1]).remakes(s) for s in (0, 1)] == [False, True]
    assert autopar.Plan(pp=2, remake=[1, 1]).remake == (1,)
    with pytest.raises(ValueError, match=r"names stages \[2\] outside 0..1 \(the plan has 2 stages\)"):
        autopar.Plan(pp=2, remake=(0, 2))
    with pytest.raises(ValueError, match="remake='all' must be True"):
        autopar.Plan(remake="all")


def test_the_planners_json_feeds_back():
    from autopar.planner import plan_model
    from autopar.planner.devices import get_profile
    from autopar.planner.report import to_json
    from autopar.planner.search import to_plan
    from tests.models import make_gpt

    case = make_gpt()
    for compile_ in (False, True):  # autopar plan --compile: the plan runs its programs compiled
        res, info = plan_model(case.model, case.inputs, case.target, case.loss_fn, gpus=4, global_batch=8,
                               device=get_profile("h100"), compile=compile_)
        data = json.loads(json.dumps(to_json(res, info)))
        assert autopar.Plan.from_json(data) == to_plan(res, res.chosen)
        assert data["compile"] is compile_ and to_plan(res, res.chosen).compile is compile_
    # the report names recomputed stages recompute_stages
    assert autopar.Plan.from_json({"pp": 2, "schedule": "1f1b", "recompute_stages": [1]}).recompute == (1,)


class _DroplessNet(torch.nn.Module):
    """Two dropless ``autopar.nn.MoE`` blocks (token-proportional dispatch) between linears."""

    def __init__(self):
        super().__init__()
        from autopar.nn import MoE

        self.inp = torch.nn.Linear(6, 16)
        self.blocks = torch.nn.ModuleList(MoE(16, 24, 4, 2, capacity_factor=None) for _ in range(2))
        self.head = torch.nn.Linear(16, 3)

    def forward(self, x):
        h = self.inp(x)
        aux = h.new_zeros(())
        for blk in self.blocks:
            y, a = blk(h)
            h, aux = h + y, aux + a
        return self.head(h), aux


def test_dropless_moe_plan_carries_the_priced_imbalance():
    """A plan with ep > 1 on a dropless MoE carries the imbalance its worst-rank receive was
    priced at (Plan.moe_imbalance, the runtime's receive bound), through --json too; ep = 1
    (no dispatch across ranks) carries none."""
    from autopar.planner import plan_model
    from autopar.planner.devices import get_profile
    from autopar.planner.report import to_json
    from autopar.planner.search import to_plan

    torch.manual_seed(0)
    x, t = torch.randn(8, 4, 6), torch.randn(8, 4, 3)

    def loss(out, target):
        return torch.nn.functional.mse_loss(out[0], target) + out[1]

    net = _DroplessNet()
    cases = (({"ep": 2, "pp": 1}, 1.5, 1.5), ({"ep": 2, "pp": 1}, None, 1.25), ({"ep": 1, "pp": 1}, 1.5, None))
    for pin, imb, want in cases:
        res, info = plan_model(net, (x,), t, loss, gpus=4, global_batch=8, device=get_profile("h100"),
                               n_experts=4, pin=pin, moe_imbalance=imb, allow_cp=False)
        assert res.chosen is not None and res.chosen.layout.ep == pin["ep"]
        assert res.evaluator.moe_imbalance == (imb or 1.25)
        plan = to_plan(res, res.chosen)
        assert plan.moe_imbalance == want, (pin, imb)
        data = json.loads(json.dumps(to_json(res, info)))
        assert autopar.Plan.from_json(data) == plan
        assert autopar.Plan.from_json(plan.to_json()) == plan
