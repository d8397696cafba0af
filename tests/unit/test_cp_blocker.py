"""context_parallel_blocker(captured, cp): the planner's cheap check that the Ulysses CP pass
(passes/context_parallel.py) accepts a graph. None exactly when apply_context_parallel succeeds
(checked on a fake process group, no communication), else the pass's own error message."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F


class _Attn(nn.Module):
    """Embedding-free attention layer over [B, T, d] in several forms."""

    def __init__(self, mode: str, heads: int = 2, d: int = 12, seq: int = 16):
        super().__init__()
        self.mode, self.heads = mode, heads
        self.qkv = nn.Linear(d, 3 * d)
        self.register_buffer("rope", torch.randn(seq, d // heads), persistent=False)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        q = q * self.rope[:t]  # a position table sliced by the length
        i = torch.arange(t, device=x.device)
        if self.mode == "window":  # hand-written attention with a banded mask
            band = (i[:, None] - i[None, :]).abs() <= 2
            y = (q @ k.transpose(-1, -2)).masked_fill(~band, float("-inf")).softmax(-1) @ v
        elif self.mode == "bmm":
            qb, kb, vb = (z.reshape(b * self.heads, t, -1) for z in (q, k, v))
            y = torch.bmm(torch.bmm(qb, kb.transpose(1, 2)).softmax(-1), vb).view(b, self.heads, t, -1)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=i[:, None] >= i[None, :])
        return y.transpose(1, 2).reshape(b, t, d)


def _capture(mode, length, heads=2, d=12):
    from autopar.passes import capture

    torch.manual_seed(0)
    model = _Attn(mode, heads=heads, d=d)
    x, y = torch.randn(2, length, d), torch.randn(2, length, d)
    return capture(model, (x,), y, F.mse_loss)


@pytest.fixture
def fake_group():
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")

    def make(cp):
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=cp)
        return dist.group.WORLD

    yield make
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.parametrize("mode,heads,d,length,cp,expect", [
    ("causal", 2, 12, 8, 2, None),
    ("window", 2, 12, 8, 2, None),
    ("causal", 3, 12, 8, 2, "3 query heads and 3/3 key/value heads; cp=2 must divide every head count"),
    ("bmm", 2, 12, 8, 2, "is over 3-d scores"),
    ("causal", 4, 16, 8, 4, "positions 0..8 of b_model_rope (length 16 along dim 0); with cp=4 the full sequence needs "
                            "0..32"),
], ids=["sdpa-causal-mask", "region-window", "heads", "bmm", "table-too-short"])
def test_blocker_agrees_with_the_pass(fake_group, mode, heads, d, length, cp, expect):
    """On a shard capture (shard=True): None iff the pass rewrites it, else the pass's message;
    the graph is not changed."""
    from autopar.passes.context_parallel import apply_context_parallel, context_parallel_blocker

    captured = _capture(mode, length, heads, d)
    before = captured.gm.code
    reason = context_parallel_blocker(captured, cp, shard=True)
    assert captured.gm.code == before
    group = fake_group(cp)
    if expect is None:
        assert reason is None, reason
        apply_context_parallel(captured, cp, 0, group)
    else:
        assert reason is not None and expect in reason, reason
        with pytest.raises(ValueError) as info:
            apply_context_parallel(captured, cp, 0, group)
        assert str(info.value) == reason


def test_blocker_on_the_full_length_capture():
    """What the planner has: one capture at the full sequence length S answers every cp."""
    from autopar.passes.context_parallel import context_parallel_blocker

    captured = _capture("window", 16)
    assert context_parallel_blocker(captured, 1) is None
    assert context_parallel_blocker(captured, 2) is None
    assert "cp=4 must divide every head count" in context_parallel_blocker(captured, 4)
    assert "sequence length 16 does not divide by 3" in context_parallel_blocker(captured, 3)
    assert "3-d scores" in context_parallel_blocker(_capture("bmm", 16), 2)
