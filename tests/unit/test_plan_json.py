"""Plan is data that round-trips: ``Plan.from_json(plan.to_json())`` keeps every field, and the
JSON ``autopar plan --json`` prints, fed back, gives the plan the planner chose."""
import json
from dataclasses import fields

import autopar


def test_every_field_round_trips():
    plan = autopar.Plan(pp=2, dp=2, cp=1, ep=1, schedule="zb-h1", num_microbatches=4, stages_per_rank=1,
                        stage_cuts=(17,), recompute=(1,), zero=2)
    back = autopar.Plan.from_json(plan.to_json())
    assert back == plan
    assert {f.name for f in fields(autopar.Plan)} <= set(json.loads(plan.to_json()))


def test_the_planners_json_feeds_back():
    from autopar.planner import plan_model
    from autopar.planner.devices import get_profile
    from autopar.planner.report import to_json
    from autopar.planner.search import to_plan
    from tests.models import make_gpt

    case = make_gpt()
    res, info = plan_model(case.model, case.inputs, case.target, case.loss_fn, gpus=4, global_batch=8,
                           device=get_profile("h100"))
    data = json.loads(json.dumps(to_json(res, info)))
    assert autopar.Plan.from_json(data) == to_plan(res, res.chosen)
    # the report names recomputed stages recompute_stages
    assert autopar.Plan.from_json({"pp": 2, "schedule": "1f1b", "recompute_stages": [1]}).recompute == (1,)
