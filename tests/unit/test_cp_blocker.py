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

    def __init__(self, mode: str, heads: int = 2, d: int = 12, seq: int = 16, kv_heads: int = 0):
        super().__init__()
        self.mode, self.heads, self.kv_heads = mode, heads, kv_heads
        self.qkv = nn.Linear(d, 3 * d)
        self.register_buffer("rope", torch.randn(seq, d // heads), persistent=False)
        self.sinks = nn.Parameter(torch.randn(heads))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        q = q * self.rope[:t]  # a position table sliced by the length
        i = torch.arange(t, device=x.device)
        if self.mode == "gqa":  # grouped-query SDPA over the first kv_heads key/value heads
            kv = self.kv_heads
            y = F.scaled_dot_product_attention(q, k[:, :kv], v[:, :kv], is_causal=True, enable_gqa=True)
        elif self.mode == "window":  # hand-written attention with a banded mask
            band = (i[:, None] - i[None, :]).abs() <= 2
            y = (q @ k.transpose(-1, -2)).masked_fill(~band, float("-inf")).softmax(-1) @ v
        elif self.mode in ("position-ids", "chunked"):  # transformers' masks with use_cache=False
            pos = (i + 0).unsqueeze(0).expand(b, -1)  # position_ids, read by index below
            bi, qi, ki = (torch.arange(b)[:, None, None, None], i[None, None, :, None], i[None, None, None, :])
            keep = pos[bi, ki] <= pos[bi, qi]
            if self.mode == "position-ids":  # and the packed-sequence check over the whole sequence
                packed = (torch.diff(pos, prepend=pos[:, :1] - 1, dim=-1) != 1).cumsum(-1)
                keep = keep & (packed[bi, qi] == packed[bi, ki])
            else:  # chunks of 4 after the left padding, a reduction over the sequence of a model input
                pad = (x.sum(-1) != 0).long()
                left = (pad.cumsum(-1) == torch.zeros_like(pad)).sum(-1)
                keep = keep & ((pos[bi, ki] - left[bi]) // 4 == (pos[bi, qi] - left[bi]) // 4)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=keep.expand(b, -1, t, t))
        elif self.mode in ("sinks", "sinks-after-pv"):  # GPT-OSS: learned per-head sink logits
            w = q @ k.transpose(-1, -2) * 0.5 + torch.where(i[:, None] >= i[None, :], 0.0, float("-inf"))
            sinks = self.sinks.reshape(1, -1, 1, 1).expand(b, -1, t, -1)
            w = torch.cat([w, sinks], -1)
            p = (w - w.max(-1, keepdim=True).values).softmax(-1)
            y = p[..., :-1] @ v if self.mode == "sinks" else (p @ torch.cat([v, v[:, :, :1]], 2))
        elif self.mode == "padded-sink":  # the extra logit by F.pad: not a region op
            w = F.pad(q @ k.transpose(-1, -2), (0, 1))
            y = w.softmax(-1)[..., :-1] @ v
        elif self.mode == "flip":  # an op mixing the keys beside the element-wise path
            w = q @ k.transpose(-1, -2)
            y = (w + w.flip(-1)).softmax(-1) @ v
        elif self.mode == "query-max":  # a reduction over the queries inside the region
            w = q @ k.transpose(-1, -2)
            y = (w - w.amax(-2, keepdim=True)).softmax(-1) @ v
        elif self.mode == "bmm":
            qb, kb, vb = (z.reshape(b * self.heads, t, -1) for z in (q, k, v))
            y = torch.bmm(torch.bmm(qb, kb.transpose(1, 2)).softmax(-1), vb).view(b, self.heads, t, -1)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=i[:, None] >= i[None, :])
        return y.transpose(1, 2).reshape(b, t, d)


def _capture(mode, length, heads=2, d=12, kv_heads=0):
    from autopar.passes import capture

    torch.manual_seed(0)
    model = _Attn(mode, heads=heads, d=d, kv_heads=kv_heads)
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
    ("position-ids", 2, 12, 8, 2, None),
    ("chunked", 2, 12, 8, 2, None),
    ("sinks", 2, 12, 8, 2, None),
    ("sinks", 3, 12, 8, 2, "cannot rewrite because it has 3 query heads"),
    ("sinks-after-pv", 2, 12, 8, 2, "cannot rewrite because the probabilities reach matmul_1 with the 1 extra columns"),
    ("query-max", 2, 12, 8, 2, "cannot rewrite because amax (amax) reduces over dims [-2]"),
    ("flip", 2, 12, 8, 2, "cannot rewrite because the scores matmul are also used by flip"),
    ("padded-sink", 2, 12, 8, 2, "attention found at matmul (q @ k^T matmul, softmax softmax), cannot rewrite because "
                                 "between the scores and the softmax there is pad (pad)"),
], ids=["sdpa-causal-mask", "region-window", "heads", "bmm", "table-too-short", "position-ids-mask", "chunked-mask",
        "sinks", "sinks-heads", "sinks-kept", "query-reduction", "keys-mixed",
        "pad-not-followed"])
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


@pytest.mark.parametrize("name,use_cache", [("llama", False), ("llama", True), ("gpt_oss", False)],
                         ids=["llama-no-cache", "llama-cache", "gpt_oss-sinks"])
def test_blocker_agrees_on_hf_decoders(fake_group, name, use_cache):
    """transformers' masks with and without a cache (use_cache=False: position_ids read by index and
    the packed-sequence check) and GPT-OSS's sink attention: the blocker passes the full-length
    capture the planner has and the shard capture, and the pass rewrites the shard capture (on a
    fake group: the numbers are checked in tests/dist/test_hf_context_parallel.py)."""
    from autopar.passes import capture
    from autopar.passes.context_parallel import apply_context_parallel, context_parallel_blocker
    from tests.hf_models import make_hf

    case = make_hf(name, seed=0, batch=2, seq=16, use_cache=use_cache)
    if name == "llama" and not use_cache:  # (one full-length capture: each costs ~2 s)
        full = capture(case.model, case.inputs, case.target, case.loss_fn)
        assert context_parallel_blocker(full, 2) is None
    shard = capture(case.model, (case.inputs[0][:, :8],), case.target[:, :8], case.loss_fn)
    assert context_parallel_blocker(shard, 2, shard=True) is None
    out = apply_context_parallel(shard, 2, 0, fake_group(2))
    a2a = sum("all_to_all" in str(n.target) for n in out.gm.graph.nodes)
    assert a2a == (10 if name == "gpt_oss" else 8), a2a  # q, k, v, out (+ the sinks) per layer, 2 layers


def test_kv_repeats_give_each_rank_the_heads_its_queries_read():
    """Brute force over head counts: after each key/value head is repeated kv_repeats(Hkv, cp)
    times and the heads are split into cp equal blocks, local query head i of rank r reads local
    key/value head i // (local q heads / local kv heads), and that is head h // (Hq / Hkv) of the
    original grouped-query attention for its global query head h."""
    from autopar.passes.cp_rules import kv_repeats

    checked = 0
    for hkv in range(1, 13):
        for group in range(1, 5):
            hq = hkv * group
            for cp in (c for c in range(2, hq + 1) if hq % c == 0):
                rep = kv_repeats(hkv, cp)
                copies = [j for j in range(hkv) for _ in range(rep)]  # repeat_interleave order
                assert len(copies) % cp == 0, (hq, hkv, cp, rep)
                lkv, lq = len(copies) // cp, hq // cp
                assert lq % lkv == 0, (hq, hkv, cp, rep)
                for r in range(cp):
                    local = copies[r * lkv:(r + 1) * lkv]
                    for i in range(lq):
                        assert local[i // (lq // lkv)] == (r * lq + i) // group, (hq, hkv, cp, r, i)
                checked += 1
    assert checked > 100
    # hand values: cp dividing Hkv repeats nothing; one head per rank when cp >= Hkv
    assert (kv_repeats(8, 4), kv_repeats(8, 16), kv_repeats(8, 64), kv_repeats(6, 4)) == (1, 2, 8, 2)


@pytest.mark.parametrize("hq,hkv,cp,per_rank", [(12, 6, 4, 3), (4, 1, 4, 1), (4, 2, 2, 1)])
def test_grouped_query_sdpa_takes_cp_up_to_its_query_heads(fake_group, hq, hkv, cp, per_rank):
    """enable_gqa SDPA: cp must divide the query heads only; the rewritten attention reads
    per_rank key/value heads (hand-counted: lcm(Hkv, cp) / cp) over the whole sequence, and the
    planner reads the query heads as the cp limit."""
    from autopar.passes.context_parallel import apply_context_parallel, context_parallel_blocker
    from autopar.passes.cp_rules import ATTENTION_OPS, grouped_kv_heads
    from autopar.planner.profile import attention_heads

    length = 16
    full = _capture("gqa", length, heads=hq, d=hq, kv_heads=hkv)
    assert attention_heads(full.gm) == hq
    assert [grouped_kv_heads(n) for n in full.gm.graph.nodes if n.target in ATTENTION_OPS] == [hkv]
    assert context_parallel_blocker(full, cp) is None
    bad = next(c for c in range(2, 17) if hq % c and length % c == 0)
    assert "must divide the query heads" in context_parallel_blocker(full, bad)
    shard = _capture("gqa", length // cp, heads=hq, d=hq, kv_heads=hkv)
    rewritten = apply_context_parallel(shard, cp, 0, fake_group(cp))
    sdpa = next(n for n in rewritten.gm.graph.nodes if n.target in ATTENTION_OPS)
    q, k, v = (a.meta["val"].shape for a in sdpa.args[:3])
    assert (q[1], q[2]) == (hq // cp, length) and (k[1], k[2]) == (per_rank, length) and v == k
