"""P-item 6: parallelize() without a plan asks the planner for the world; every rank gets the
same plan and training equals the eager reference of design.md §5 for that plan."""
import copy
import functools
import json

import pytest

from tests.dist.harness import run_shared

pytestmark = pytest.mark.slow


def _train_auto(rank, world, steps):
    import torch

    import autopar
    from tests.models import ALL_CASES

    opt = functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.1, eps=1e-4)
    case = ALL_CASES["gpt"](seed=5)
    pm = autopar.parallelize(case.model, case.inputs, loss_fn=case.loss_fn, optimizer=opt,
                             example_target=case.target)
    losses = [pm.step(case.inputs, case.target) for _ in range(steps)]
    return {"plan": pm.plan.to_json(), "losses": losses,
            "state": {k: v.clone() for k, v in pm.state_dict().items()}}


def test_auto_plan_on_two_ranks(tmp_path, monkeypatch):
    import torch

    from tests.models import ALL_CASES
    from tests.reference import assert_close_state, eager_reference

    monkeypatch.setenv("AUTOPAR_CACHE_DIR", str(tmp_path))  # the cpu profile is measured and cached here
    res = run_shared(_train_auto, 2, 2, deadline_s=300)
    assert res[0]["plan"] == res[1]["plan"], "every rank must run the same plan"
    plan = json.loads(res[0]["plan"])
    assert plan["pp"] * plan["dp"] * plan["cp"] * plan["tp"] == 2
    opt = functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.1, eps=1e-4)
    case = ALL_CASES["gpt"](seed=5)
    ref_losses, ref_state = eager_reference(copy.deepcopy(case.model), case.inputs, case.target, case.loss_fn, opt,
                                            dp=plan["dp"], num_microbatches=plan["num_microbatches"], steps=2)
    for r in range(2):
        for step in range(2):
            torch.testing.assert_close(res[r]["losses"][step], ref_losses[step], rtol=1e-5, atol=0)
        assert_close_state(res[r]["state"], ref_state)
