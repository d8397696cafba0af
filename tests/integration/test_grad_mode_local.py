"""Issue 52, G1 in local mode: a region of the forward run without gradient (``no_grad``,
``enable_grad`` inside it, ``set_grad_enabled(False)``, ``inference_mode``) trains exactly as
eager PyTorch does — values computed there carry no gradient, a parameter used only there gets
none (AdamW's weight decay skips it), a parameter used there and again later gets the later
use's gradient — at pp=1, at pp=2 zbv with the stage cuts inside the region, at its output
(the value crosses the cut and is detached in the next stage) and after it, and with
recomputation on the stages that hold it. The distributed cases are tests/dist/test_grad_mode_gloo.py.
"""
import copy
import functools

import pytest
import torch

import autopar
from autopar.passes import capture, split_backward, split_stages
from tests.models import GRAD_MODES, make_grad_modes
from tests.reference import eager_reference

# AdamW with weight decay: a zero gradient where eager has none would still move the parameter
ADAMW = functools.partial(torch.optim.AdamW, lr=1e-1, weight_decay=0.1)


def _region_output(case) -> int:
    """Position (among compute nodes) of the detach that ends the no-grad region."""
    cap = capture(case.model, tuple(x[:2] for x in case.inputs), case.target[:2], case.loss_fn)
    order = [n for n in cap.gm.graph.nodes if n.op in ("call_function", "get_attr")]
    detaches = [i for i, n in enumerate(order) if n.target is torch.ops.aten.detach.default]
    assert len(detaches) == 1, [n.name for n in order]
    return detaches[0]


def _check(case, plan: autopar.Plan, label: str):
    m = plan.num_microbatches
    ref_losses, ref_state = eager_reference(copy.deepcopy(case.model), case.inputs, case.target, case.loss_fn,
                                            ADAMW, num_microbatches=m, steps=2)
    pm = autopar.parallelize(copy.deepcopy(case.model), case.inputs, loss_fn=case.loss_fn, optimizer=ADAMW,
                             plan=plan, example_target=case.target)
    for step in range(2):
        loss = pm.step(case.inputs, case.target)
        torch.testing.assert_close(loss, ref_losses[step], rtol=1e-6, atol=0, msg=lambda s: f"{label} step {step}: {s}")
    state = pm.state_dict()
    for fqn, want in ref_state.items():
        torch.testing.assert_close(state[fqn], want, rtol=0, atol=1e-6, msg=lambda s, f=fqn: f"{label} {f}: {s}")
    return pm


@pytest.mark.parametrize("variant", GRAD_MODES)
def test_grad_mode_region_trains_like_eager(variant):
    case = make_grad_modes(seed=3, variant=variant)
    # the parameter used only inside the region gets no gradient in eager: AdamW leaves it alone
    eager = copy.deepcopy(case.model)
    case.loss(eager).backward()
    assert eager.only_there.weight.grad is None
    assert (eager.first.weight.grad is None) == (variant != "enable_inside")

    _check(case, autopar.Plan(pp=1, num_microbatches=2), f"{variant} pp=1")
    d = _region_output(case)
    plans = [((d - 2, d, d + 2), ())]  # cut inside the region, at its output, after it
    if variant in ("no_grad", "enable_inside"):  # the other spellings capture to the same graph
        plans += [((d - 2, d, d + 2), (0, 1)),     # ... recomputing the stages that hold it
                  ((1, 2, d + 1), ())]             # the region whole in stage 2
    for cuts, recompute in plans:
        plan = autopar.Plan(pp=2, schedule="zbv", num_microbatches=4, stage_cuts=cuts, recompute=recompute)
        _check(case, plan, f"{variant} pp=2 zbv cuts={cuts} recompute={recompute}")


def test_no_backward_work_inside_the_region():
    """The planner prices the programs split_backward makes: hand-count their GEMMs. With the
    region at batch B=2, width 16, head 16->4: the input gradient runs through head, mid (its
    second use) and after[2], after[1] (after[0]'s input is the detached value: no gradient), and
    the weight gradient is taken for head, mid, after[0..2]; first, only_there and the region's
    use of mid cost nothing in the backward (without the detach the backward would add first's,
    only_there's and the region's GEMMs, and after[0]'s input gradient)."""
    case = make_grad_modes(seed=0, variant="no_grad")
    B, d, out = 2, 16, 4
    cap = capture(case.model, tuple(x[:B] for x in case.inputs), case.target[:B], case.loss_fn)
    (stage,) = split_stages(cap, 1)
    prog = split_backward(stage, {})
    assert set(prog.grad_params) == {f"{m}.{p}" for m in ("head", "mid", "after.0", "after.1", "after.2")
                                     for p in ("weight", "bias")}
    activation_grads = 2 * B * out * d + 3 * 2 * B * d * d
    weight_grads = 2 * B * out * d + 4 * 2 * B * d * d
    # one stage has no stage input: every backward GEMM lands in W (and in the fused B)
    assert prog.i.flops + prog.w.flops == prog.b.flops == activation_grads + weight_grads
