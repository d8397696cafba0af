"""passes/capture: FQNs, tied weights, buffers, cost annotation, and CaptureError messages."""
import time

import pytest
import torch
import torch.nn as nn

import autopar
from autopar.passes import capture
from tests.models import make_cnn_bn, make_gpt


def test_gpt_capture_keeps_fqns_and_dedups_tied_weight():
    case = make_gpt()
    cap = capture(case.model, tuple(x[:2] for x in case.inputs), case.target[:2], case.loss_fn)
    fqns = set(cap.params.values())
    unique = {n for n, _ in case.model.named_parameters()}  # named_parameters dedups tied weights
    assert fqns == unique
    tied = [names for names in cap.aliases.values() if len(names) > 1]
    assert tied == [["wte.weight", "lm_head.weight"]]
    loss = cap.node(cap.loss)
    assert loss.meta["val"].shape == ()
    mm_flops = sum(n.meta.get("autopar_flops", 0) for n in cap.gm.graph.nodes)
    # lm head alone: 2 * tokens * d * vocab
    assert mm_flops >= 2 * 2 * 32 * 32 * 256
    cap.gm.graph.lint()


def test_batchnorm_updates_become_outputs():
    case = make_cnn_bn()
    cap = capture(case.model, tuple(x[:2] for x in case.inputs), case.target[:2], case.loss_fn)
    bn = {n for n, _ in case.model.named_buffers()}
    assert set(cap.buffer_updates.values()) == bn
    assert set(cap.buffers.values()) == bn


class _Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        h = self.lin(x)
        if h.sum() > 0:  # data-dependent branch
            h = h * 2
        return h.sum()


def test_data_dependent_control_flow_raises_capture_error_naming_the_line():
    t0 = time.perf_counter()
    with pytest.raises(autopar.CaptureError) as info:
        capture(_Branchy(), (torch.randn(2, 4),))
    elapsed = time.perf_counter() - t0
    msg = str(info.value)
    assert "test_capture.py" in msg and "if h.sum() > 0" in msg, msg
    assert "data-dependent" in msg and "Fix:" in msg
    assert elapsed < 30


class _VectorLoss(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x)


def test_non_scalar_loss_is_a_clear_error():
    with pytest.raises(ValueError, match="scalar"):
        capture(_VectorLoss(), (torch.randn(2, 4),))


def test_loss_fn_without_target_is_a_clear_error():
    with pytest.raises(ValueError, match="target"):
        capture(_VectorLoss(), (torch.randn(2, 4),), None, lambda o, t: o.sum())


def test_non_tensor_input_is_a_clear_error():
    with pytest.raises(ValueError, match="input 1"):
        capture(_VectorLoss(), (torch.randn(2, 4), 3))
