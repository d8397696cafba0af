"""runtime/streams: the communication stream and the local-mode stand-in transfers.

On CPU the side stream is the calling thread (launch is a no-op); local mode with
``local_transfers=True`` moves every value crossing pipeline ranks through ``CommStream.copy``
and must still give the eager reference's numbers. The CUDA cases run where a GPU is
present (benchmarks/gpu_check.py is the full R7 check with a profiler trace).
"""
import copy
import functools

import pytest
import torch

import autopar
from autopar.runtime.streams import CommStream
from tests.models import make_gpt, make_skip
from tests.reference import assert_close_state, eager_reference


def test_cpu_copy_is_a_fresh_equal_tensor():
    cs = CommStream("cpu")
    src = {"a": torch.randn(3, 4).t(), "b": torch.arange(5)}
    tr = cs.copy(src)
    out = tr.wait()
    for n, t in src.items():
        assert torch.equal(out[n], t) and out[n].data_ptr() != t.data_ptr() and out[n].stride() == t.stride()
    with cs.launch():
        pass  # no stream on CPU


def _train_with_transfers(case, schedule: str, device="cpu", steps=2):
    model = copy.deepcopy(case.model).to(device)
    inputs = tuple(x.to(device) for x in case.inputs)
    target = case.target.to(device)
    pm = autopar.parallelize(model, inputs, loss_fn=case.loss_fn, optimizer=functools.partial(torch.optim.SGD, lr=0.1),
                             plan=autopar.Plan(pp=2, schedule=schedule, num_microbatches=4), example_target=target,
                             local_transfers=True)
    losses = [pm.step(inputs, target).item() for _ in range(steps)]
    executor = pm.built.executor
    assert executor.transfers is not None and not executor._in_flight  # every copy was consumed
    return losses, {k: v.detach().cpu() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("make,schedule", [(make_gpt, "zb-h1"), (make_skip, "zbv")], ids=["gpt-zb-h1", "skip-zbv"])
def test_local_transfers_match_eager(make, schedule, monkeypatch):
    """Every value crossing pipeline ranks goes through CommStream.copy, and two SGD steps
    still equal the eager reference of design.md section 5."""
    case = make()
    ref_losses, ref_state = eager_reference(case.model, case.inputs, case.target, case.loss_fn,
                                            functools.partial(torch.optim.SGD, lr=0.1), num_microbatches=4)
    copies = []
    original = CommStream.copy

    def counting(self, values):
        copies.append(len(values))
        return original(self, values)

    monkeypatch.setattr(CommStream, "copy", counting)
    losses, state = _train_with_transfers(case, schedule)
    assert copies, "no value crossed pipeline ranks through the communication stream"
    torch.testing.assert_close(torch.tensor(losses), torch.stack(ref_losses), rtol=1e-5, atol=0)
    assert_close_state(state, ref_state)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_local_transfers_match_eager():
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    case = make_gpt()
    ref_losses, ref_state = eager_reference(case.model, case.inputs, case.target, case.loss_fn,
                                            functools.partial(torch.optim.SGD, lr=0.1), num_microbatches=4)
    losses, state = _train_with_transfers(case, "zb-h1", device="cuda")
    torch.testing.assert_close(torch.tensor(losses), torch.stack(ref_losses), rtol=1e-5, atol=1e-6)
    assert_close_state(state, ref_state)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_copy_waits_for_the_producer_and_is_waited_for():
    cs = CommStream("cuda")
    a = torch.randn(2048, 2048, device="cuda")
    for _ in range(3):
        a = a @ a / 2048 ** 0.5  # queued on the compute stream; the copy must see the result
    expected = a.cpu()
    tr = cs.copy({"a": a})
    out = tr.wait()["a"] * 1.0  # compute stream, ordered after the copy
    assert torch.equal(out.cpu(), expected)
