"""R1/R2: PP and PP x DP over gloo processes equal the eager reference of design.md §5."""
import copy
import functools

import pytest

from tests.dist.harness import run_ranks

pytestmark = pytest.mark.slow


def _train(rank, world, case_name, plan_kwargs, steps, generated=True):
    import torch

    import autopar
    from tests.models import ALL_CASES

    opt = functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.1, eps=1e-4)  # see tests/integration/test_local_equivalence.py
    case = ALL_CASES[case_name](seed=5)
    pm = autopar.parallelize(case.model, case.inputs, loss_fn=case.loss_fn, optimizer=opt,
                             plan=autopar.Plan(**plan_kwargs), example_target=case.target,
                             generated=generated)
    losses = [pm.step(case.inputs, case.target) for _ in range(steps)]
    planned = [str(a) for a in pm.schedule.actions[rank % pm.plan.pp]]
    return {"losses": losses, "state": {k: v.clone() for k, v in pm.state_dict().items()},
            "executed": list(pm.executed_actions), "planned": planned}


def _reference(case_name, dp, m, steps):
    import torch

    from tests.models import ALL_CASES
    from tests.reference import eager_reference

    opt = functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.1, eps=1e-4)  # see tests/integration/test_local_equivalence.py
    case = ALL_CASES[case_name](seed=5)
    return eager_reference(copy.deepcopy(case.model), case.inputs, case.target, case.loss_fn, opt,
                           dp=dp, num_microbatches=m, steps=steps)


CASES = [
    ("gpt", dict(pp=2, schedule="1f1b", num_microbatches=4)),
    ("gpt", dict(pp=2, schedule="zb-h1", num_microbatches=4)),
    ("gpt", dict(pp=2, schedule="zbv", num_microbatches=4)),
    ("llama", dict(pp=2, schedule="dualpipev", num_microbatches=4)),
    ("gpt", dict(pp=2, dp=2, schedule="zb-h1", num_microbatches=2)),
]


@pytest.mark.parametrize("case_name,plan", CASES, ids=[f"{c}-{p['schedule']}-pp{p['pp']}-dp{p.get('dp', 1)}" for c, p in CASES])
def test_gloo_matches_eager(case_name, plan):
    import torch

    from tests.reference import assert_close_state

    world = plan["pp"] * plan.get("dp", 1)
    results = run_ranks(_train, world, case_name, plan, 2)
    ref_losses, ref_state = _reference(case_name, plan.get("dp", 1), plan["num_microbatches"], 2)
    for r, res in enumerate(results):
        for step in range(2):
            torch.testing.assert_close(res["losses"][step], ref_losses[step], rtol=1e-5, atol=0,
                                       msg=lambda m: f"rank {r} step {step}: {m}")
        assert_close_state(res["state"], ref_state)
        assert res["executed"] == res["planned"], f"rank {r} ran {res['executed']} planned {res['planned']}"


def test_generated_program_equals_interpreter():
    """R2: the generated straight-line program and the interpreter of the same actions agree exactly."""
    import torch

    plan = dict(pp=2, schedule="zbv", num_microbatches=4)
    gen = run_ranks(_train, 2, "gpt", plan, 2, True)
    interp = run_ranks(_train, 2, "gpt", plan, 2, False)
    for r in range(2):
        assert gen[r]["executed"] == interp[r]["executed"] == gen[r]["planned"]
        for step in range(2):
            assert torch.equal(gen[r]["losses"][step], interp[r]["losses"][step])
        for k, v in gen[r]["state"].items():
            assert torch.equal(v, interp[r]["state"][k]), k
