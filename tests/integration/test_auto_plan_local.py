"""parallelize() without a plan in local mode: the planner plans for one device; the result
equals the eager reference for the chosen microbatching."""
import copy
import functools

import pytest
import torch

import autopar
from tests.models import ALL_CASES
from tests.reference import assert_close_state, eager_reference

ADAMW = functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.1, eps=1e-4)


@pytest.mark.parametrize("case_name", ["gpt", "llama"])
def test_local_auto_plan_matches_eager(case_name, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("AUTOPAR_CACHE_DIR", str(tmp_path))
    case = ALL_CASES[case_name](seed=2)
    with caplog.at_level("INFO", logger="autopar"):
        pm = autopar.parallelize(case.model, case.inputs, loss_fn=case.loss_fn, optimizer=ADAMW,
                                 example_target=case.target)
    assert "planner: pp=" in caplog.text and pm.planner_summary
    assert pm.plan.world_size == 1
    ref_losses, ref_state = eager_reference(copy.deepcopy(case.model), case.inputs, case.target, case.loss_fn, ADAMW,
                                            dp=1, num_microbatches=pm.plan.num_microbatches, steps=2)
    for step in range(2):
        loss = pm.step(case.inputs, case.target)
        torch.testing.assert_close(loss, ref_losses[step].to(loss.dtype), rtol=1e-5, atol=0)
    assert_close_state(pm.state_dict(), ref_state)
