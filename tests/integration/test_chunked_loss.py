"""Issue 35 M1: the chunked cross-entropy (passes/chunked_loss.py) against eager PyTorch.

This repository's GPT (a loss_fn, tied head), Hugging Face Llama and Gemma-2 (soft-capped
logits) with labels in the batch (the model's own loss), padding labels (-100) included; pp=1
and pp=2 under zbv (W deferred), two optimizer steps: loss 1e-5, parameters 1e-4.
"""
import copy
import functools

import pytest
import torch
import torch.nn.functional as F

import autopar
from autopar import linear_ce
from autopar.passes import capture
from autopar.passes.chunked_loss import chunk_losses, find_linear_losses
from tests.models import make_gpt
from tests.reference import assert_close_state, eager_reference

SGD = functools.partial(torch.optim.SGD, lr=0.5, momentum=0.9)
PLANS = [dict(pp=1, num_microbatches=2), dict(pp=2, schedule="zbv", num_microbatches=4)]


def _labels_batch(name: str, seed: int = 0):
    """A tiny HF causal LM and a batch with labels in it; a quarter of the labels are padding."""
    from tests.hf_models import VOCAB, build_hf

    model = build_hf(name, seed=seed, use_cache=False)
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, VOCAB, (8, 16), generator=g)
    labels = ids.clone()
    labels[torch.rand(labels.shape, generator=g) < 0.25] = -100
    return model, {"input_ids": ids, "labels": labels}


def _eager_full_batch(model, batch, steps: int = 2):
    """One eager forward over the whole global batch per step (the model's loss: the mean over
    every valid label of the batch), SGD as the run's."""
    opt = SGD(model.parameters())
    losses = []
    for _ in range(steps):
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _chunked_ops(pm) -> set:
    return {n.target for prog in pm.programs if hasattr(prog, "f") for part in (prog.f, prog.i, prog.w)
            for n in part.gm.graph.nodes if n.op == "call_function"}


@pytest.mark.parametrize("plan", PLANS, ids=["pp1", "pp2-zbv"])
def test_gpt_loss_fn_chunked_matches_eager(plan):
    case = make_gpt(seed=1)
    target = case.target.clone()
    target[:, ::3] = -100
    want_losses, want_state = eager_reference(copy.deepcopy(case.model), case.inputs, target, case.loss_fn, SGD,
                                              num_microbatches=plan["num_microbatches"], steps=2)
    pm = autopar.parallelize(case.model, case.inputs, loss_fn=case.loss_fn, optimizer=SGD, example_target=target,
                             plan=autopar.Plan(**plan, loss_chunk_tokens=24))
    assert {linear_ce.FORWARD_OP, linear_ce.GRAD_WEIGHT_OP} <= _chunked_ops(pm)
    for step in range(2):
        torch.testing.assert_close(pm.step(case.inputs, target), want_losses[step], rtol=1e-5, atol=0)
    assert_close_state(pm.state_dict(), want_state, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("plan", PLANS, ids=["pp1", "pp2-zbv"])
@pytest.mark.parametrize("name", ["llama", "gemma2"])
def test_hf_labels_chunked_matches_eager(name, plan):
    """Gemma-2 soft-caps its logits (div, tanh, mul) between the head and the loss."""
    model, batch = _labels_batch(name)
    want_losses, want_state = _eager_full_batch(copy.deepcopy(model), batch)
    pm = autopar.parallelize(model, batch, loss_fn=None, optimizer=SGD,
                             plan=autopar.Plan(**plan, loss_chunk_tokens=40))
    assert linear_ce.FORWARD_OP in _chunked_ops(pm)
    for step in range(2):
        torch.testing.assert_close(pm.step(batch, None), want_losses[step], rtol=1e-5, atol=0)
    assert_close_state(pm.state_dict(), want_state, rtol=1e-4, atol=1e-6)


def test_what_is_matched_and_what_is_kept():
    """The GPT head + loss is found; the chunked graph holds no [tokens, vocab] value; a loss
    with label smoothing (another formula) is left as captured."""
    case = make_gpt(seed=0)
    cap = capture(case.model, case.inputs, case.target, case.loss_fn)
    (m,) = find_linear_losses(cap.gm)
    tokens = case.inputs[0].shape[0] * case.inputs[0].shape[1]
    assert (m.tokens, m.vocab) == (tokens, case.model.wte.weight.shape[0])
    new, n = chunk_losses(cap.gm, 16)
    assert n == 1 and len(find_linear_losses(cap.gm)) == 1  # the input graph is unchanged
    vocab_sized = [nd.name for nd in new.graph.nodes if isinstance(nd.meta.get("val"), torch.Tensor)
                   and nd.meta["val"].numel() >= tokens * m.vocab]
    assert not vocab_sized, vocab_sized

    def smoothed(out, y):
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1), label_smoothing=0.1)

    cap = capture(case.model, case.inputs, case.target, smoothed)
    assert find_linear_losses(cap.gm) == [] and chunk_losses(cap.gm, 16)[1] == 0


def test_linear_cross_entropy_op_against_torch():
    """The op itself, bf16 head with an fp32 cast and soft-capping, chunks that do not divide
    the tokens, a bias, ignored targets: loss and all three gradients against F.cross_entropy."""
    g = torch.Generator().manual_seed(0)
    h = torch.randn(37, 16, generator=g, requires_grad=True)
    w = torch.randn(50, 16, generator=g, requires_grad=True)
    b = torch.randn(50, generator=g, requires_grad=True)
    t = torch.randint(0, 50, (37,), generator=g)
    t[::5] = -100
    want = F.cross_entropy(torch.tanh(F.linear(h, w, b) / 3.0) * 3.0, t)
    got = linear_ce.linear_cross_entropy(h, w, t, b, chunk_tokens=8,
                                         epilogue=(("div", 3.0), ("tanh", 0.0), ("mul", 3.0)))
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    for a, c in zip(torch.autograd.grad(want, (h, w, b)), torch.autograd.grad(got, (h, w, b))):
        torch.testing.assert_close(c, a, rtol=1e-5, atol=1e-7)
