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


class _SplitBySizes(nn.Module):
    """A hand-written MoE: expert split sizes read with ``.tolist()`` (data-dependent sizes)."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(4, 2)
        self.experts = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))

    def forward(self, x):
        ids = self.router(x).argmax(-1)
        order = torch.argsort(ids)
        sizes = torch.bincount(ids, minlength=2).tolist()  # the sizes line
        parts = torch.split(x[order], sizes)
        return torch.cat([e(p) for e, p in zip(self.experts, parts)]).sum()


class _MaskSelect(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        h = self.lin(x)
        return h[h > 0].sum()  # the mask line


class _NumpyOp(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        h = self.lin(x)
        return torch.from_numpy(h.detach().numpy()).sum() + h.sum()  # the numpy line


def _line_of(marker: str) -> int:
    import inspect

    lines = inspect.getsource(inspect.getmodule(_line_of)).splitlines()
    return next(i for i, text in enumerate(lines, 1) if marker in text and "_line_of" not in text)


@pytest.mark.parametrize("model, marker, kind", [
    (_SplitBySizes, "# the sizes line", "a number read from a tensor"),
    (_MaskSelect, "# the mask line", "a data-dependent shape"),
    (_NumpyOp, "# the numpy line", "an operation torch.export cannot capture"),
], ids=["tolist-sizes", "mask-select", "numpy"])
def test_capture_failures_name_the_file_line_and_kind(model, marker, kind, capsys):
    """Issue 52 G2: each failure is a CaptureError naming this file and the offending line, what
    kind of problem it is and the fix, with torch's own exception chained (when torch raised
    one), and torch's partial graph is not printed over it."""
    with pytest.raises(autopar.CaptureError) as info:
        capture(model(), (torch.randn(4, 4),))
    msg = str(info.value)
    assert f"test_capture.py:{_line_of(marker)}:" in msg, msg
    assert kind in msg and "Fix:" in msg, msg
    if model is _SplitBySizes:
        assert "autopar.nn.MoE" in msg  # the supported way to write the pattern
        assert info.value.__cause__ is not None
    assert "def forward" not in capsys.readouterr().err


class _NoGradInAutocast(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        h = self.a(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            with torch.no_grad():  # the autocast line
                h = self.b(h)
            h = h.float()
        return h.sum()


def test_no_grad_inside_autocast_is_refused_by_name():
    """torch.export records no grad mode for a no_grad block inside the model's own autocast
    block (its ops would carry gradients): refused, naming the line, never trained wrongly."""
    with pytest.raises(autopar.CaptureError, match=r"inside a torch.autocast block at .*test_capture.py:"
                                                   rf"{_line_of('# the autocast line')}:"):
        capture(_NoGradInAutocast(), (torch.randn(4, 4),))


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


class _LearnedMaskAttention(nn.Module):
    """SDPA with a learned [B, H, S, S] additive mask (T5's relative position bias), its heads
    merged by ``transpose(1, 2).contiguous().view(...)`` as Hugging Face models do."""

    def __init__(self, d: int = 8, heads: int = 2, seq: int = 4):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.bias = nn.Parameter(torch.randn(heads, seq, seq))

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).unbind(2)
        mask = (2 * self.bias).expand(b, -1, -1, -1)
        y = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                             attn_mask=mask)
        return y.transpose(1, 2).contiguous().view(b, s, d)


def test_cost_replay_keeps_the_traced_strides():
    """Export traces SDPA without requires_grad (flash layout, [B, S, H, D] in memory) and drops
    the ``.contiguous()`` as a no-op; a fake replay with the parameters requiring grad gets the
    math kernel's layout, on which the graph's bare ``view`` is invalid. annotate_costs replays
    each op on its traced layout instead, and counts what the trace recorded."""
    from torch.utils.flop_counter import sdpa_flop_count

    from autopar.passes.costs import annotate_costs, value_bytes

    torch.manual_seed(0)
    ep = torch.export.export(_LearnedMaskAttention(), (torch.randn(2, 4, 8),), strict=False).run_decompositions({})
    gm = annotate_costs(ep.graph_module)
    sdpa = [n for n in gm.graph.nodes if n.target is torch.ops.aten.scaled_dot_product_attention.default]
    assert len(sdpa) == 1
    q = sdpa[0].args[0].meta["val"]
    assert sdpa[0].meta["autopar_flops"] == sdpa_flop_count(q.shape, q.shape, q.shape) == 4 * 2 * 2 * 4 * 4 * 4
    for n in gm.graph.nodes:
        if n.op == "call_function":
            assert n.meta["autopar_bytes"] == value_bytes(n.meta["val"]), n.name


def test_capture_of_a_learned_mask_attention_trains_like_eager():
    """The capture puts the dropped copy back before the view, so the joint trace and the real
    run (math kernel: the mask requires grad) can run it: local mode equals eager."""
    import functools

    import torch.nn.functional as F

    from tests.reference import assert_close_state, eager_reference

    torch.manual_seed(0)
    model = _LearnedMaskAttention()
    x, y = torch.randn(4, 4, 8), torch.randn(4, 4, 8)
    cap = capture(model, (x[:2],), y[:2], F.mse_loss)
    view = next(n for n in cap.gm.graph.nodes
                if n.target is torch.ops.aten.view.default and n.meta["val"].shape == (2, 4, 8))
    assert view.args[0].target is torch.ops.aten.clone.default, cap.gm.code
    sgd = functools.partial(torch.optim.SGD, lr=0.5)
    ref_losses, ref_state = eager_reference(model, (x,), y, F.mse_loss, sgd, num_microbatches=2, steps=2)
    pm = autopar.parallelize(model, (x,), loss_fn=F.mse_loss, optimizer=sgd, plan=autopar.Plan(num_microbatches=2),
                             example_target=y)
    for want in ref_losses:
        torch.testing.assert_close(pm.step((x,), y), want, rtol=1e-5, atol=0)
    assert_close_state(pm.state_dict(), ref_state, rtol=1e-4)
