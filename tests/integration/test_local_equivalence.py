"""A2: local mode equals the eager reference of design.md §5 (loss, every parameter and buffer).

Every model family, pp in {2, 4}, 4 microbatches, two optimizer steps, three orders: gpipe
(fused B, SGD), 1f1b (fused B, AdamW) and zb-h1 (I and W split, W deferred, SGD).
"""
import copy
import functools

import pytest
import torch

import autopar
from tests.models import ALL_CASES
from tests.reference import assert_close_state, eager_reference

SGD = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)
# eps=1e-4, not the default 1e-8: Adam's update lr*g/(|g|+eps) has slope lr/eps at g ~ 0, so
# fp32 summation-order noise in a tiny gradient (~1e-10 absolute: an embedding row of a token
# that is absent from the batch; the attention key bias, whose exact gradient is 0) becomes
# an lr/eps-times larger parameter difference. With lr/eps = 100 that stays far below the
# 1e-5 contract, and a wrong gradient still changes parameters by ~lr.
ADAMW = functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.1, eps=1e-4)
RUNS = [("gpipe", SGD), ("1f1b", ADAMW), ("zb-h1", SGD)]
# moe_ep exists for expert parallelism (tests/dist/test_beyond_pp_dp.py runs it end to end)
FAMILIES = sorted(set(ALL_CASES) - {"moe_ep"})


@pytest.fixture(scope="module", autouse=True)
def _one_capture_per_model():
    """Every plan of one model reuses its capture (tests/models.memoized_capture)."""
    import autopar.passes
    from tests.models import memoized_capture

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(autopar.passes, "capture", memoized_capture(autopar.passes.capture))
        yield


@pytest.mark.parametrize("pp", [2, 4])
@pytest.mark.parametrize("case_name", FAMILIES)
def test_local_mode_matches_eager(case_name, pp):
    for schedule, opt in RUNS:
        case = ALL_CASES[case_name](seed=1)
        ref_losses, ref_state = eager_reference(copy.deepcopy(case.model), case.inputs, case.target, case.loss_fn,
                                                opt, dp=1, num_microbatches=4, steps=2)
        plan = autopar.Plan(pp=pp, schedule=schedule, num_microbatches=4)
        pm = autopar.parallelize(case.model, case.inputs, loss_fn=case.loss_fn, optimizer=opt, plan=plan,
                                 example_target=case.target)
        assert len(pm.stages) == pp
        for step in range(2):
            loss = pm.step(case.inputs, case.target)
            torch.testing.assert_close(loss, ref_losses[step].to(loss.dtype), rtol=1e-5, atol=0,
                                       msg=lambda m: f"{case_name} pp={pp} {schedule} step {step}: {m}")
        assert_close_state(pm.state_dict(), ref_state)
        ran = [[a for a in acts] for acts in pm.executed_actions]
        planned = [[str(a) for a in acts] for acts in pm.schedule.actions]
        assert ran == planned


def test_dp_in_local_mode_matches_eager():
    case = ALL_CASES["gpt"](seed=2)
    ref_losses, ref_state = eager_reference(copy.deepcopy(case.model), case.inputs, case.target, case.loss_fn,
                                            ADAMW, dp=2, num_microbatches=2, steps=2)
    pm = autopar.parallelize(case.model, case.inputs, loss_fn=case.loss_fn, optimizer=ADAMW,
                             plan=autopar.Plan(pp=2, dp=2, num_microbatches=2, schedule="gpipe"),
                             example_target=case.target)
    for step in range(2):
        torch.testing.assert_close(pm.step(case.inputs, case.target), ref_losses[step], rtol=1e-5, atol=0)
    assert_close_state(pm.state_dict(), ref_state)


def test_recompute_matches_eager():
    case = ALL_CASES["llama"](seed=3)
    ref_losses, ref_state = eager_reference(copy.deepcopy(case.model), case.inputs, case.target, case.loss_fn,
                                            ADAMW, dp=1, num_microbatches=4, steps=2)
    pm = autopar.parallelize(case.model, case.inputs, loss_fn=case.loss_fn, optimizer=ADAMW,
                             plan=autopar.Plan(pp=2, schedule="zb-h1", num_microbatches=4, recompute=(0, 1)),
                             example_target=case.target)
    for prog in pm.programs:
        assert not [k for k in prog.i.args if k.startswith("saved:")], "recomputed I reads only stage inputs"
        assert prog.saved_bytes == 0
    for step in range(2):
        torch.testing.assert_close(pm.step(case.inputs, case.target), ref_losses[step], rtol=1e-5, atol=0)
    assert_close_state(pm.state_dict(), ref_state)


@pytest.mark.parametrize("schedule", ["interleaved-1f1b", "zb-h2", "zb-auto", "zbv", "v-half", "v-min", "dualpipev"])
def test_every_schedule_runs_in_local_mode(schedule):
    """Local mode runs every schedule of the family (V and interleaved ones: 2 stages per rank)."""
    from autopar.schedules import default_stages_per_rank

    case = ALL_CASES["gpt"](seed=4)
    m = 4  # = 2 * pp, what zbv and dualpipev need
    ref_losses, ref_state = eager_reference(copy.deepcopy(case.model), case.inputs, case.target, case.loss_fn,
                                            ADAMW, dp=1, num_microbatches=m, steps=2)
    pm = autopar.parallelize(case.model, case.inputs, loss_fn=case.loss_fn, optimizer=ADAMW,
                             plan=autopar.Plan(pp=2, schedule=schedule, num_microbatches=m),
                             example_target=case.target)
    assert len(pm.stages) == 2 * default_stages_per_rank(schedule)
    for step in range(2):
        torch.testing.assert_close(pm.step(case.inputs, case.target), ref_losses[step], rtol=1e-5, atol=0)
    assert_close_state(pm.state_dict(), ref_state)
    assert [list(a) for a in pm.executed_actions] == [[str(x) for x in acts] for acts in pm.schedule.actions]


def test_remake_keep_and_recompute_per_stage_match_eager():
    """``Plan.remake`` per stage beside ``recompute``: stage 0 keeps every element-wise value,
    stage 1 makes them again in its backward, stage 2 recomputes; ``stage_table`` says so, the
    remaking stage keeps fewer bytes than the same stage keeping them, and training equals eager."""
    case = ALL_CASES["llama"](seed=4)
    ref_losses, ref_state = eager_reference(copy.deepcopy(case.model), case.inputs, case.target, case.loss_fn,
                                            ADAMW, dp=1, num_microbatches=4, steps=2)
    kept = autopar.parallelize(copy.deepcopy(case.model), case.inputs, loss_fn=case.loss_fn, optimizer=ADAMW,
                               plan=autopar.Plan(pp=3, schedule="zb-h1", num_microbatches=4),
                               example_target=case.target)
    pm = autopar.parallelize(case.model, case.inputs, loss_fn=case.loss_fn, optimizer=ADAMW,
                             plan=autopar.Plan(pp=3, schedule="zb-h1", num_microbatches=4, remake=(1,),
                                               recompute=(2,)), example_target=case.target)
    table = pm.stage_table().splitlines()
    modes = ("keep", "remake", "recompute")
    assert "backward" in table[0]
    assert [next(w for w in row.split() if w in modes) for row in table[2:5]] == list(modes), table
    assert pm.programs[1].saved_bytes < kept.programs[1].saved_bytes
    assert pm.programs[0].saved_bytes == kept.programs[0].saved_bytes
    for step in range(2):
        torch.testing.assert_close(pm.step(case.inputs, case.target), ref_losses[step], rtol=1e-5, atol=0)
    assert_close_state(pm.state_dict(), ref_state)
