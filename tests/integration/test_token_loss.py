"""Issue 37 item 2 for a loss_fn: a token-mean cross-entropy of the target with ``ignore_index``
(passes/token_loss.py recognizes it in the graph) is normalized by the valid targets of the
whole global batch, as one eager forward over all of it: microbatches holding different numbers
of valid targets give the same loss and gradients (1e-5 / 1e-4) as the full batch, at pp=1 m=2,
pp=2 zbv and dp=2 (local mode). Other losses keep the per-microbatch rule."""
import copy
import functools

import pytest
import torch
import torch.nn.functional as F

import autopar
from autopar.passes import capture
from autopar.passes.token_loss import ignore_index_of
from tests.models import make_gpt


def _uneven_target(case):
    """-100 on most of the first rows' positions, few of the last rows': every microbatch holds a
    different count of valid targets."""
    target = case.target.clone()
    for r in range(target.shape[0]):
        target[r, : 3 * (target.shape[0] - r)] = -100
    return target


@pytest.mark.parametrize("plan", [dict(pp=1, num_microbatches=2), dict(pp=2, schedule="zbv", num_microbatches=4),
                                  dict(dp=2, num_microbatches=2)], ids=["pp1-m2", "pp2-zbv", "dp2-local"])
def test_cross_entropy_with_ignore_index_is_one_mean_over_the_global_batch(plan):
    case = make_gpt(seed=2)
    target = _uneven_target(case)
    counts = [int((t != -100).sum()) for t in target.split(2)]
    assert len(set(counts)) == len(counts), counts
    ref = copy.deepcopy(case.model)
    want = case.loss_fn(ref(*case.inputs), target)  # one forward over the whole batch
    want.backward()
    before = {n: p.detach().clone() for n, p in case.model.named_parameters()}
    pm = autopar.parallelize(case.model, case.inputs, loss_fn=case.loss_fn, example_target=target,
                             optimizer=functools.partial(torch.optim.SGD, lr=1.0), plan=autopar.Plan(**plan))
    assert pm.built.target_ignore_index == -100
    torch.testing.assert_close(pm.step(case.inputs, target), want.detach(), rtol=1e-5, atol=0)
    state = pm.state_dict()
    for n, p in ref.named_parameters():
        torch.testing.assert_close(before[n] - state[n], p.grad, rtol=1e-4, atol=1e-6, msg=n)


def test_which_losses_are_token_means():
    case = make_gpt()

    def ignore(loss_fn):
        return ignore_index_of(capture(case.model, case.inputs, case.target, loss_fn))

    v = 256
    assert ignore(case.loss_fn) == -100
    assert ignore(lambda out, t: F.cross_entropy(out.reshape(-1, v), t.reshape(-1), ignore_index=7)) == 7
    assert ignore(lambda out, t: F.nll_loss(F.log_softmax(out, -1).reshape(-1, v), t.reshape(-1))) == -100
    assert ignore(lambda out, t: F.cross_entropy(out.reshape(-1, v), t.reshape(-1), reduction="sum")) is None
    assert ignore(lambda out, t: F.cross_entropy(out.reshape(-1, v), t.reshape(-1), weight=torch.ones(v))) is None
    assert ignore(lambda out, t: F.cross_entropy(out[:, :-1].reshape(-1, v), t[:, 1:].reshape(-1))) is None
    assert ignore(lambda out, t: F.cross_entropy(out.reshape(-1, v), t.reshape(-1)) + out.mean()) is None
