"""R3: bad plans fail on every rank before any communication; a dead or stuck peer is reported
(naming the rank, the step and the action) within the timeout, never a silent hang."""
import time

import pytest

from autopar.runtime.spawn import run_ranks

pytestmark = pytest.mark.slow


def _parallelize(rank, world, plan_kwargs, batch=8):
    import autopar
    from tests.models import ALL_CASES

    case = ALL_CASES["gpt"](seed=0)
    inputs, target = tuple(x[:batch] for x in case.inputs), case.target[:batch]
    try:
        autopar.parallelize(case.model, inputs, loss_fn=case.loss_fn, plan=autopar.Plan(**plan_kwargs),
                            example_target=target)
    except ValueError as e:
        return f"ValueError: {e}"
    return "no error"


@pytest.mark.parametrize("plan,batch,expect", [
    (dict(pp=4), 8, "pp*dp*cp*tp = 4*1*1*1 = 4 ranks but the process group has 2"),
    (dict(pp=2, schedule="1f1b", num_microbatches=1), 8, "m=1"),
    (dict(pp=2, num_microbatches=4), 6, "not divisible"),
], ids=["world-mismatch", "too-few-microbatches", "batch-not-divisible"])
def test_bad_plan_fails_on_every_rank_before_communication(plan, batch, expect):
    results = run_ranks(_parallelize, 2, plan, batch, deadline_s=60)
    for r, msg in enumerate(results):
        assert msg.startswith("ValueError") and expect in msg, f"rank {r}: {msg}"


def _train_with_fault(rank, world, fault, timeout):
    import os

    import autopar
    from tests.models import ALL_CASES

    case = ALL_CASES["gpt"](seed=0)
    pm = autopar.parallelize(case.model, case.inputs, loss_fn=case.loss_fn,
                             plan=autopar.Plan(pp=2, schedule="1f1b", num_microbatches=4),
                             example_target=case.target, timeout=timeout)
    pm.step(case.inputs, case.target)
    if rank == 1 and fault == "die":
        os._exit(3)
    if rank == 1 and fault == "stuck":
        time.sleep(12)  # longer than rank 0's 8 s timeout plus its 2 s report, then carry on
    t0 = time.monotonic()
    try:
        pm.step(case.inputs, case.target)
    except RuntimeError as e:
        return f"{type(e).__name__} after {time.monotonic() - t0:.1f}s: {e}"
    return "no error"


@pytest.mark.parametrize("fault", ["die", "stuck"])
def test_dead_or_stuck_peer_is_reported(fault):
    t0 = time.monotonic()
    results = run_ranks(_train_with_fault, 2, fault, 8.0, deadline_s=55, expect_failure=True)
    assert time.monotonic() - t0 < 60
    status, msg = results[0]
    assert status == "ok" and msg.startswith("PeerTimeout"), results[0]
    assert "rank 1" in msg and "step 1" in msg, msg      # who and when
    assert "RECV_B" in msg or "RECV_F" in msg, msg        # what it was waiting for
    assert "rank 1: no report" in msg, msg               # the other rank's position (it can't answer)
