"""Ulysses context parallelism (passes/context_parallel.py).

Two gloo ranks each capture the model on their half of the sequence, apply the pass, split into
1 and 2 stages (both stages run on the same rank, in order) and run the real F then B, and F, I,
W programs with a loss tangent of 1/cp. The mean of the local losses must equal the eager
full-sequence loss, and the gradients summed over the ranks must equal the eager gradients
(1e-5 relative). The error messages are checked without processes, on a fake process group.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.dist.harness import run_shared

CP = 2
MB = 2  # microbatch
# case -> stage counts to split into
CASES = {"llama": (1, 2), "gpt": (2,), "flash": (1,), "gqa": (1,), "mqa": (1,), "manual-mask": (1,),
         "arange-causal": (1,), "window": (1,)}


def _case(name: str):
    """Two-layer versions of tests/models' llama and gpt (the 4-layer ones double the trace time)."""
    from autopar.examples.gpt import make_gpt
    from tests.models import Llama, _ce

    if name == "llama":  # causal SDPA, RoPE buffers sliced [:t], GQA by repeat_interleave (4 q, 2 kv heads)
        torch.manual_seed(3)
        model = Llama(vocab_size=256, seq_len=32, n_layers=2)
        tokens = torch.randint(0, 256, (MB, 33))
        return model, tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous(), _ce
    if name == "gpt":  # causal SDPA, learned positions through nn.Embedding(torch.arange(t)), tied head
        model, (idx,), target, loss_fn = make_gpt(n_layer=2, d_model=32, n_head=4, seq_len=32, batch_size=MB, seed=3)
        return model, idx, target, loss_fn
    # flash: the CPU flash kernel called directly (a tuple output whose logsumexp is unused);
    # gqa: SDPA with enable_gqa=True (4 q heads, 2 k/v heads); mqa: the same with 1 k/v head, fewer
    # than cp (the pass repeats it so each rank gets the one its 2 query heads read); manual-mask: hand-written attention
    # (a region) masked by a tril buffer sliced [:t, :t] (rebuilt from 2 x 2 blocks); arange-causal:
    # SDPA with `i[:, None] >= i[None, :]` (one arange for both dims: proven causal, is_causal=True);
    # window: a region with a banded mask from one arange
    torch.manual_seed(3)
    return _Attn(name, seq=8, heads=4, d=16), torch.randn(MB, 8, 16), torch.randn(MB, 8, 16), _mse


def _run_stages(programs, params, state, data, mode: str):
    """One microbatch through the stage programs (all on this rank): F in order, then backward in
    reverse order as B, or as I then W. Returns the local loss; gradients land in params[...].grad."""
    from autopar.runtime.stage_work import StageWork

    work = StageWork(dict(enumerate(programs)), len(programs), state, params)
    work.begin([data], 1.0 / CP)  # loss tangent 1/cp: the runtime averages over the cp ranks
    for s in range(len(programs)):
        work.forward(s, 0)
        outs = work.take_outputs(s, 0)
        if s + 1 < len(programs):
            work.put_inputs(s + 1, 0, outs)
    for s in reversed(range(len(programs))):
        if mode == "B":
            work.full_backward(s, 0)
        else:
            work.input_grads(s, 0)
        gin = work.take_input_grads(s, 0)
        if s > 0:
            work.put_grads(s - 1, 0, gin)
        if mode == "IW":
            work.weight_grads(s, 0)
    return work.losses[0].detach()


def _cp_rank(rank, world, cases):
    import torch.distributed as dist

    from autopar.passes import capture, keys, split_stages, stage_programs
    from autopar.passes.context_parallel import apply_context_parallel
    from autopar.passes.cp_rules import ATTENTION_OPS, _arg

    results = {}
    for name, stage_counts in cases.items():
        model, x, y, loss_fn = _case(name)
        s = x.shape[1] // CP
        x_local, y_local = x[:, rank * s:(rank + 1) * s].contiguous(), y[:, rank * s:(rank + 1) * s].contiguous()
        captured = apply_context_parallel(capture(model, (x_local,), y_local, loss_fn), CP, rank, dist.group.WORLD)
        captured.gm.graph.lint()
        collectives = sum(1 for n in captured.gm.graph.nodes if "all_to_all" in str(n.target))
        causal = any(_arg(n, "is_causal") for n in captured.gm.graph.nodes if n.target in ATTENTION_OPS)
        params = dict(model.named_parameters())
        trainable = set(params)
        state = keys.state(params, dict(model.named_buffers()), captured.constants)
        data = {captured.inputs[0]: x_local, captured.target: y_local}
        for num_stages in stage_counts:
            programs = stage_programs(split_stages(captured, num_stages), trainable)
            # where the backward all-to-alls went: I of every stage with a differentiable input
            i_collectives = [sum(1 for n in p.i.gm.graph.nodes if "all_to_all" in str(n.target)) for p in programs]
            for mode in ("B", "IW"):
                for p in params.values():
                    p.grad = None
                loss = _run_stages(programs, params, state, data, mode)
                grads = {f: p.grad.clone() for f, p in params.items() if p.grad is not None}
                for g in grads.values():
                    dist.all_reduce(g)  # sum over the cp ranks (each already scaled by 1/cp)
                results[name, num_stages, mode] = {"loss": loss, "grads": grads, "collectives": collectives,
                                                   "i_collectives": i_collectives, "causal": causal}
    return results


def _eager(name):
    model, x, y, loss_fn = _case(name)
    loss = loss_fn(model(x), y)
    loss.backward()
    return loss.detach(), {f: p.grad for f, p in model.named_parameters() if p.grad is not None}


def _assert_close(actual, expected, what):
    # 1e-5 relative, with an absolute floor of 1e-5 of the tensor's largest entry (as tests/reference.py)
    atol = 1e-5 * expected.abs().max().item()
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=atol, msg=lambda m: f"{what}: {m}")


@pytest.mark.slow  # ~20 s of CPU per rank (captures and joint traces), more on a busy 2-core machine
def test_ulysses_cp2_matches_full_sequence():
    """cp=2 on 2 gloo ranks: Llama (RoPE tables, GQA by repeat; 1 and 2 stages), GPT (arange
    positions; 2 stages), the CPU flash kernel called directly and SDPA with enable_gqa=True (1 stage);
    F then B, and F, I, W: the mean of the local losses == the full-sequence loss, and the all-reduced
    grads (tangent 1/cp) == the full-sequence grads."""
    per_rank = run_shared(_cp_rank, CP, CASES, deadline_s=180, reuse=False)
    assert len(per_rank[0]) == 2 * sum(len(v) for v in CASES.values())
    for name in CASES:
        ref_loss, ref_grads = _eager(name)
        for key in sorted(k for k in per_rank[0] if k[0] == name):
            res = [r[key] for r in per_rank]
            label = f"{name} stages={key[1]} {key[2]}"
            assert res[0]["collectives"] > 0, f"{label}: no all-to-all in the rewritten graph"
            assert res[0]["causal"] == (name in ("arange-causal", "llama", "gpt", "gqa", "mqa", "flash")), (label, res[0])
            if key[1] == 2:
                assert res[0]["i_collectives"][1] > 0, f"{label}: stage 1's I program has no backward all-to-all"
            mean_loss = sum(r["loss"] for r in res) / CP
            _assert_close(mean_loss, ref_loss, f"{label} loss")
            assert set(res[0]["grads"]) == set(ref_grads), label
            for f, g in ref_grads.items():
                for r in range(CP):
                    _assert_close(res[r]["grads"][f], g, f"{label} grad {f} (rank {r})")


# ---------------------------------------------------------------------------------------------
# errors (no processes: a fake process group)


@pytest.fixture
def fake_group():
    """make(cp, rank) -> a fake process group of cp ranks as the default group (no communication;
    values it "receives" are garbage): enough for the checks and for fake-tensor shapes."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")

    def make(cp, rank=0):
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=cp)
        return dist.group.WORLD

    yield make
    if dist.is_initialized():
        dist.destroy_process_group()


def _capture_local(model, x, y, loss_fn, cp, rank=0):
    from autopar.passes import capture

    s = x.shape[1] // cp
    return capture(model, (x[:, rank * s:(rank + 1) * s],), y[:, rank * s:(rank + 1) * s], loss_fn)


def _llama(**kw):
    from tests.models import Llama, _ce

    torch.manual_seed(0)
    model = Llama(**kw)
    seq = kw.get("seq_len", 32)
    tokens = torch.randint(0, 256, (2, seq + 1))
    return model, tokens[:, :-1], tokens[:, 1:], _ce


class _Attn(nn.Module):
    """One attention layer over [B, T, d] with a configurable mask / extra output."""

    def __init__(self, mode, seq=8, heads=2, d=8):
        super().__init__()
        self.mode, self.heads = mode, heads
        self.qkv = nn.Linear(d, 3 * d)
        self.register_buffer("mask", torch.tril(torch.ones(seq, seq, dtype=torch.bool)), persistent=False)
        if mode == "param-bias":
            self.bias = nn.Parameter(torch.zeros(seq, seq))

    def forward(self, x):
        b, t, d = x.shape
        if self.mode == "none":
            return self.qkv(x)[..., :d]
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        i = torch.arange(t, device=x.device)
        if self.mode == "arange-causal":
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=i[:, None] >= i[None, :])
        elif self.mode == "window":
            band = (i[:, None] - i[None, :]).abs() <= 2
            y = (q @ k.transpose(-1, -2) * 0.5).masked_fill(~band, float("-inf")).softmax(-1) @ v
        elif self.mode == "bmm":  # heads merged into the batch: 3-d scores
            qb, kb, vb = (z.reshape(b * self.heads, t, -1) for z in (q, k, v))
            y = torch.bmm(torch.bmm(qb, kb.transpose(1, 2)).softmax(-1), vb).view(b, self.heads, t, -1)
        elif self.mode == "param-bias":
            y = (q @ k.transpose(-1, -2) + self.bias[:t, :t]).softmax(-1) @ v
        elif self.mode == "weights-used":
            att = (q @ k.transpose(-1, -2)).softmax(-1)
            y = att @ v + att.mean()
        elif self.mode == "cumsum-mask":
            m = self.mask[:t, :t].int().cumsum(-1) > 1
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=m)
        elif self.mode == "lse":
            y, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True)
            y = y + lse.unsqueeze(-1)
        elif self.mode in ("gqa", "mqa"):  # native GQA: half as many k/v heads, or one
            kv = self.heads // 2 if self.mode == "gqa" else 1
            k, v = k[:, 1:1 + kv], v[:, -kv:]
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        elif self.mode == "flash":
            y = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True)[0]
        elif self.mode == "manual":
            y = (q @ k.transpose(-1, -2)).softmax(-1) @ v
        elif self.mode == "manual-mask":
            att = (q @ k.transpose(-1, -2)).masked_fill(~self.mask[:t, :t], float("-inf")).softmax(-1)
            y = att @ v
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return y.transpose(1, 2).reshape(b, t, d)


def _mse(out, target):
    return F.mse_loss(out, target)


@pytest.mark.parametrize("mode,cp,expect", [
    ("heads", 4, "3 query heads and 3/3 key/value heads; cp=4 must divide every head count"),
    ("gqa", 4, "6 query heads over 3 key/value heads; cp=4 must divide the query heads (Ulysses gives each cp "
               "rank 6/cp of them): use a cp that divides 6"),
    ("lse", 2, "output 1 (logsumexp) is used by"),
    ("bmm", 2, "is over 3-d scores; context parallelism rewrites attention over [batch, heads, seq, seq] scores"),
    ("param-bias", 2, "depends on a parameter"),
    ("weights-used", 2, "the attention probabilities softmax are used by"),
    ("cumsum-mask", 2, "computed with cumsum"),
    ("none", 2, "cp=2, but the graph has no attention"),
], ids=["heads-not-divisible", "query-heads-not-divisible", "logsumexp-used", "bmm-attention", "learned-bias",
        "probabilities-used", "mask-op-not-followed", "no-attention"])
def test_errors_name_the_problem_and_the_fix(fake_group, mode, cp, expect):
    from autopar.passes.context_parallel import apply_context_parallel

    heads = {"heads": 3, "gqa": 6}.get(mode, 2)
    model = _Attn(mode, seq=8, heads=heads, d=12)
    x, y = torch.randn(2, 8, 12), torch.randn(2, 8, 12)
    captured = _capture_local(model, x, y, _mse, cp)
    before = captured.gm.code
    with pytest.raises(ValueError, match="autopar: ") as info:
        apply_context_parallel(captured, cp, 0, fake_group(cp))
    assert expect in str(info.value), str(info.value)
    if mode != "none":  # names the node and the user's line
        assert "[node " in str(info.value) and "test_context_parallel.py:" in str(info.value), str(info.value)
    assert captured.gm.code == before, "a failing pass must leave the graph as it was"


def test_error_rope_table_too_short(fake_group):
    from autopar.passes.context_parallel import apply_context_parallel

    model, x, y, loss_fn = _llama(seq_len=24, n_layers=1)
    x, y = torch.cat([x, x[:, :8]], 1), torch.cat([y, y[:, :8]], 1)  # 32 tokens, table of 24
    captured = _capture_local(model, x, y, loss_fn, 2)
    with pytest.raises(ValueError, match=r"positions 0\.\.16 of b_model_rope_cos \(length 24 along dim 0\).*"
                                         r"at least 32 long"):
        apply_context_parallel(captured, 2, 0, fake_group(2))


def test_error_group_disagrees(fake_group):
    from autopar.passes.context_parallel import apply_context_parallel

    model, x, y, loss_fn = _llama(n_layers=1)
    captured = _capture_local(model, x, y, loss_fn, 2)
    with pytest.raises(ValueError, match="the cp group has 4 ranks"):
        apply_context_parallel(captured, 2, 0, fake_group(4))


def test_rewrite_keeps_fx_contract(fake_group):
    """On a fake group: lint holds, every node has a fake value and costs, positions are offset,
    each attention gets 3 + 1 all-to-alls, and the output keeps the attention output's strides."""
    from autopar.passes.context_parallel import apply_context_parallel

    model, x, y, loss_fn = _llama(n_layers=2)
    captured = _capture_local(model, x, y, loss_fn, 2, rank=1)
    attn_before = [n for n in captured.gm.graph.nodes if "scaled_dot_product" in str(n.target)]
    consumers = {u.name: tuple(n.meta["val"].stride()) for n in attn_before for u in n.users}
    before = captured.gm.code
    captured = apply_context_parallel(captured, 2, 1, fake_group(2, rank=1))
    assert captured.gm.code != before
    graph = captured.gm.graph
    graph.lint()
    for n in graph.nodes:
        if n.op != "output":
            assert "val" in n.meta, n.format_node()
            assert "autopar_bytes" in n.meta, n.format_node()
    attn = [n for n in graph.nodes if "scaled_dot_product" in str(n.target)]
    assert [tuple(n.meta["val"].shape) for n in attn] == [(2, 2, 32, 8)] * 2  # [B, H/cp, S, D]
    assert sum(1 for n in graph.nodes if "all_to_all" in str(n.target)) == 4 * len(attn)
    for name, strides in consumers.items():  # what read the attention output reads [B, H, s, D], same layout
        back = captured.node(name).args[0]
        assert tuple(back.meta["val"].shape) == (2, 4, 16, 8) and tuple(back.meta["val"].stride()) == strides
    slices = [n for n in graph.nodes if n.target is torch.ops.aten.slice.Tensor and n.args[0].op == "placeholder"]
    assert {n.args[2:4] for n in slices} == {(16, 32)}
    assert captured.summary()
