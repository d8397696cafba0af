"""Issue 52, G1 on gloo: a no-grad region of the forward (tests/models.GradModeMLP) trains
exactly as eager at pp=2 zbv with stage cuts inside the region, at its output and after it
(with and without recomputation), at dp=2 x pp=2 1f1b (ZeRO 0 and 3), and at tp=2 (with
sequence parallelism too). The parameter used only inside the region gets no gradient on any
rank, so AdamW's weight decay leaves it alone.
"""
import copy
import functools

import pytest
import torch

from tests.dist.harness import run_shared

pytestmark = pytest.mark.slow

ADAMW = functools.partial(torch.optim.AdamW, lr=1e-1, weight_decay=0.1)
# the region's detach is compute node 5 in every variant (tests/integration/test_grad_mode_local.py finds it)
CUTS = (3, 5, 7)
MATRIX = {
    2: [("no_grad", dict(pp=2, schedule="zbv", num_microbatches=4, stage_cuts=CUTS)),
        ("enable_inside", dict(pp=2, schedule="zbv", num_microbatches=4, stage_cuts=CUTS, recompute=(0, 1))),
        ("inference_mode", dict(pp=2, schedule="1f1b", num_microbatches=2, stage_cuts=(5,))),
        # tensor parallelism shards the chain's linears around the region
        ("no_grad", dict(tp=2, num_microbatches=2)),
        ("enable_inside", dict(tp=2, num_microbatches=2, sequence_parallel=True))],
    4: [("no_grad", dict(pp=2, dp=2, schedule="1f1b", num_microbatches=2, stage_cuts=(5,))),
        ("set_grad_enabled", dict(pp=2, dp=2, schedule="1f1b", num_microbatches=2, zero=3, stage_cuts=(5,)))],
}


def _run(rank, world, subcases):
    import traceback

    import autopar
    from tests.models import make_grad_modes

    out = []
    for variant, plan in subcases:
        try:
            case = make_grad_modes(seed=3, variant=variant)
            pm = autopar.parallelize(case.model, case.inputs, loss_fn=case.loss_fn, optimizer=ADAMW,
                                     plan=autopar.Plan(**plan), example_target=case.target, timeout=60)
            losses = [pm.step(case.inputs, case.target) for _ in range(2)]
            out.append({"losses": losses, "state": pm.state_dict()})
        except Exception:  # noqa: BLE001 - report per sub-case
            out.append({"traceback": traceback.format_exc()})
    return out


@pytest.mark.parametrize("world", sorted(MATRIX))
def test_grad_mode_regions_on_gloo(world):
    from tests.models import make_grad_modes
    from tests.reference import eager_reference

    subcases = MATRIX[world]
    # reuse=False: the variants differ in forward code only, which the capture memo does not key on
    per_rank = run_shared(_run, world, subcases, deadline_s=300, reuse=False)
    for i, (variant, plan) in enumerate(subcases):
        case = make_grad_modes(seed=3, variant=variant)
        ref_losses, ref_state = eager_reference(copy.deepcopy(case.model), case.inputs, case.target, case.loss_fn,
                                                ADAMW, dp=plan.get("dp", 1), num_microbatches=plan["num_microbatches"],
                                                steps=2)
        for r in range(world):
            res = per_rank[r][i]
            assert "traceback" not in res, f"{variant} {plan} rank {r}:\n{res.get('traceback')}"
            for got, want in zip(res["losses"], ref_losses):
                torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
            for fqn, want in ref_state.items():
                torch.testing.assert_close(res["state"][fqn], want, rtol=0, atol=1e-6,
                                           msg=lambda s, f=fqn: f"{variant} {plan} rank {r} {f}: {s}")
