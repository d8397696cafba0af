"""Sanity tests of the test model zoo (tests/models.py), the GPT example and the eager
reference of design.md §5 (tests/reference.py)."""

from __future__ import annotations

import functools

import pytest
import torch

from autopar.examples.gpt import GPT, GPTConfig, gpt_loss
from autopar.examples.gpt import make_gpt as make_gpt_example
from tests.models import ALL_CASES, BATCH, ModelCase, export_case
from tests.reference import assert_close_state, eager_reference, split_batch, state_copy

# torch 2.13's ExportedProgram.run_decompositions deep-copies its module call graph, which
# trips a FutureWarning about LeafSpec inside torch itself; not ours to fix.
pytestmark = pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning")



@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """These models are tiny: intra-op threading only adds overhead, and on a shared 2-core box
    it thrashes (the file went from ~18 s to ~90 s under load). Restored afterwards."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


NAMES = sorted(ALL_CASES)
# cnn_bn: BatchNorm statistics; moe_ep: the expert capacity and the load-balance loss are per microbatch
NO_BATCH_COUPLING = [n for n in NAMES if n not in ("cnn_bn", "moe_ep")]


def _unique_named_params(model):
    return list(model.named_parameters())  # named_parameters() already de-duplicates tied ones


# --------------------------------------------------------------------------------------------
# the models
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", NAMES)
def test_case_shape(name):
    case = ALL_CASES[name]()
    assert isinstance(case, ModelCase) and case.name == name
    assert isinstance(case.inputs, tuple) and case.inputs
    for x in case.inputs:
        assert x.shape[0] == BATCH
    assert case.target.shape[0] == BATCH
    for p in case.model.parameters():
        assert p.dtype == torch.float32


@pytest.mark.parametrize("name", NAMES)
def test_forward_backward_finite(name):
    case = ALL_CASES[name]()
    loss = case.loss()
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    for pname, p in case.model.named_parameters():
        assert p.grad is not None, f"{name}: no grad for {pname}"
        assert torch.isfinite(p.grad).all(), f"{name}: non-finite grad for {pname}"


@pytest.mark.parametrize("name", NAMES)
def test_seeded(name):
    a, b, c = ALL_CASES[name](seed=0), ALL_CASES[name](seed=0), ALL_CASES[name](seed=1)
    assert_close_state(state_copy(a.model), state_copy(b.model), rtol=0, atol=0)
    for x, y in zip(a.inputs, b.inputs):
        assert torch.equal(x, y)
    assert torch.equal(a.target, b.target)
    assert any(not torch.equal(p, q) for p, q in zip(a.model.parameters(), c.model.parameters()))


@pytest.mark.parametrize("name", NAMES)
def test_export_capture(name):
    case = ALL_CASES[name]()
    ep = export_case(case)  # export(strict=False).run_decompositions({})
    # the captured program computes the same loss as eager
    eager = ALL_CASES[name]().loss()
    captured = ep.module()(*case.inputs, case.target)
    torch.testing.assert_close(captured, eager, rtol=1e-5, atol=1e-6)
    if name == "cnn_bn":
        kinds = [s.kind.name for s in ep.graph_signature.output_specs]
        assert kinds.count("BUFFER_MUTATION") == 12  # 4 BNs x (mean, var, num_batches_tracked)


def test_gpt_tied_embedding():
    case = ALL_CASES["gpt"]()
    m = case.model
    assert m.lm_head.weight is m.wte.weight
    assert isinstance(m.blocks, torch.nn.ModuleList) and len(m.blocks) == 4
    names = [n for n, _ in m.named_parameters()]
    assert "wte.weight" in names and "lm_head.weight" not in names  # one Parameter
    assert set(m.state_dict()) >= {"wte.weight", "lm_head.weight"}


def test_gpt_example_defaults_and_meta():
    model, (idx,), target, loss_fn = make_gpt_example()
    assert model.cfg == GPTConfig()
    assert idx.shape == target.shape == (8, 32) and idx.dtype == torch.long
    assert torch.equal(idx[:, 1:], target[:, :-1])  # next-token targets
    assert loss_fn is gpt_loss
    model, (idx,), target, _ = make_gpt_example(n_layer=48, d_model=1024, n_head=16,
                                                device="meta")
    assert idx.is_meta and target.is_meta
    assert all(p.is_meta for p in model.parameters())
    assert model.lm_head.weight is model.wte.weight and len(model.blocks) == 48
    assert isinstance(model, GPT)


# --------------------------------------------------------------------------------------------
# the reference
# --------------------------------------------------------------------------------------------

def test_split_batch_order():
    x = torch.arange(8)
    parts = split_batch(x, 2, 2)
    assert [[p.tolist() for p in r] for r in parts] == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
    with pytest.raises(ValueError):
        split_batch(torch.arange(6), 2, 2)


class _RecordingSGD(torch.optim.SGD):
    """SGD that records a copy of every parameter's gradient at each step."""

    def __init__(self, params, lr, log):
        super().__init__(params, lr=lr)
        self._log = log

    def step(self, closure=None):
        self._log.append([p.grad.detach().clone() for g in self.param_groups for p in g["params"]])
        return super().step(closure)


def _run(case, dp, m, steps=2):
    grads = []
    opt = functools.partial(_RecordingSGD, lr=0.1, log=grads)
    losses, state = eager_reference(case.model, case.inputs, case.target, case.loss_fn, opt,
                                    dp=dp, num_microbatches=m, steps=steps)
    names = [n for n, _ in _unique_named_params(case.model)]
    return losses, state, [dict(zip(names, g)) for g in grads]


@pytest.mark.parametrize("name", NO_BATCH_COUPLING)
def test_reference_microbatching_matches_full_batch(name):
    case = ALL_CASES[name]()
    before = state_copy(case.model)
    full_losses, full_state, full_grads = _run(case, 1, 1)
    assert_close_state(state_copy(case.model), before, rtol=0, atol=0)  # caller's model untouched
    for dp, m in [(1, 4), (2, 4)]:
        losses, state, grads = _run(case, dp, m)
        assert len(losses) == 2 and len(grads) == 2
        for got, want in zip(losses, full_losses):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
        for got, want in zip(grads, full_grads):
            assert_close_state(got, want)
        assert_close_state(state, full_state)
    # the second step saw updated parameters: its loss differs from the first
    assert not torch.equal(full_losses[0], full_losses[1])


def test_reference_batchnorm_buffers_follow_microbatches():
    case = ALL_CASES["cnn_bn"]()
    _, state1, _ = _run(case, 1, 1, steps=2)
    _, state4, _ = _run(case, 1, 4, steps=2)
    key = "block1.1.num_batches_tracked"
    assert state1[key].item() == 2 and state4[key].item() == 8
    with pytest.raises(AssertionError):  # batch-coupled: microbatching changes the result
        assert_close_state(state4, state1)
    # deterministic: the same microbatching gives the same state bit for bit
    _, again, _ = _run(case, 1, 4, steps=2)
    assert_close_state(again, state4, rtol=0, atol=0)


def test_reference_loss_fn_none():
    case = ALL_CASES["skip"]()

    class WithLoss(torch.nn.Module):
        def __init__(self, model, y):
            super().__init__()
            self.model = model
            self.register_buffer("y", y, persistent=False)

        def forward(self, x):
            return torch.nn.functional.mse_loss(self.model(x), self.y)

    # full batch only (the target buffer is not split): loss_fn=None means output is the loss
    sgd = functools.partial(torch.optim.SGD, lr=0.1)
    a, sa = eager_reference(WithLoss(case.model, case.target), case.inputs, None, None, sgd)
    b, sb = eager_reference(case.model, case.inputs, case.target, case.loss_fn, sgd)
    torch.testing.assert_close(torch.stack(a), torch.stack(b), rtol=0, atol=0)
    assert_close_state({k[len("model."):]: v for k, v in sa.items()}, sb, rtol=0, atol=0)


def test_assert_close_state_reports_key():
    exp = {"a": torch.zeros(3), "b": torch.ones(2, 2), "n": torch.tensor(3)}
    assert_close_state({k: v.clone() for k, v in exp.items()}, exp)
    assert_close_state({"a": torch.full((3,), 5e-7), "b": exp["b"] * (1 + 5e-6), "n": exp["n"]},
                       exp)
    bad = {"a": exp["a"], "b": exp["b"].clone(), "n": exp["n"]}
    bad["b"][1, 0] += 1e-3
    with pytest.raises(AssertionError, match=r"^b: .*max abs err 1\.000e-03"):
        assert_close_state(bad, exp)
    with pytest.raises(AssertionError, match=r"^n: integer"):
        assert_close_state({"a": exp["a"], "b": exp["b"], "n": torch.tensor(4)}, exp)
    with pytest.raises(AssertionError, match="missing"):
        assert_close_state({"a": exp["a"]}, exp)
    with pytest.raises(AssertionError, match="NaN"):
        assert_close_state({"a": torch.tensor([0.0, float("nan"), 0.0]), "b": exp["b"],
                            "n": exp["n"]}, exp)
