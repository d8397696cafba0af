"""Stage boundaries of every kind over gloo (issue 15 item 1): a model whose every pipeline
boundary carries a broadcast bool mask, a broadcast buffer and a broadcast parameter, a
transposed and a channels-last activation, int64 ids, a 0-dim tensor with a gradient and a
value without one, all made before the first cut and read after the last (so they cross
every boundary and reach several later stages). pp=2 with zbv (4 stages in a V) and 1f1b
match eager PyTorch after two SGD steps.

Issue 33 A3: a model that shares one layer's keys and values with every later layer (cross-layer
KV sharing, across every stage cut) at pp=2 zbv equals eager; and ranks built for different
boundary tensors (one rank's receive buffer made twice as long, as a disagreeing build would)
fail on every rank with a ValueError naming the boundary, the tensor, both sides and the line
of the user's code that made it, before any message."""
import functools
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.dist.harness import run_shared

pytestmark = pytest.mark.slow
B, T, D, L = 8, 8, 16, 6


class Crossing(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.layers = nn.ModuleList(nn.Linear(D, D) for _ in range(L))
        self.gain = nn.Parameter(torch.ones(1, 1, D))
        self.emb = nn.Embedding(D, D)
        self.register_buffer("table", torch.linspace(0, 1, T * D).view(1, T, D))

    def forward(self, x):
        h0 = self.inp(x)
        mask = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()[None].expand(x.shape[0], T, T)
        table = self.table.expand(x.shape[0], T, D)              # a broadcast buffer, no gradient
        gain = self.gain.expand(x.shape[0], T, D)                # a broadcast parameter, with a gradient
        tr = h0.transpose(1, 2)                                  # non-contiguous [B, D, T]
        cl = h0.reshape(x.shape[0], T, 4, D // 4).permute(0, 3, 1, 2).contiguous(memory_format=torch.channels_last)
        ids = x.argmax(-1)                                       # int64
        scalar = h0.pow(2).mean()                                # 0-dim, with a gradient
        plain = x.detach() * 2                                   # no gradient
        h = h0
        for layer in self.layers:
            h = torch.tanh(layer(h))
        scores = (h @ tr).masked_fill(~mask, 0.0)               # [B, T, T]
        out = scores @ h + table * gain + cl.permute(0, 2, 3, 1).reshape(h.shape) + self.emb(ids)
        return out + scalar + plain


def _case():
    torch.manual_seed(0)
    model = Crossing()
    g = torch.Generator().manual_seed(1)
    return model, torch.randn(B, T, D, generator=g), torch.randn(B, T, D, generator=g)


def _run(rank, world, plans):
    import autopar

    out = []
    for plan in plans:
        model, x, y = _case()
        pm = autopar.parallelize(model, (x,), loss_fn=F.mse_loss, optimizer=functools.partial(torch.optim.SGD, lr=0.1),
                                 plan=autopar.Plan(**plan), example_target=y)
        out.append({"losses": [pm.step((x,), y) for _ in range(2)], "state": pm.state_dict()})
    return out


PLANS = [dict(pp=2, schedule="zbv", num_microbatches=4), dict(pp=2, schedule="1f1b", num_microbatches=2)]


def test_every_kind_of_boundary_value_crosses_ranks():
    from tests.reference import assert_close_state, eager_reference

    per_rank = run_shared(_run, 2, PLANS, deadline_s=300)
    model, x, y = _case()
    for i, plan in enumerate(PLANS):
        ref_losses, ref_state = eager_reference(model, (x,), y, F.mse_loss, functools.partial(torch.optim.SGD, lr=0.1),
                                                num_microbatches=plan["num_microbatches"], steps=2)
        for r in range(2):
            res = per_rank[r][i]
            for got, want in zip(res["losses"], ref_losses):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
            assert_close_state(res["state"], ref_state)


class SharedKV(nn.Module):
    """Cross-layer KV sharing: the first layer's keys and values (two strided views of one
    projection) are read by every later layer's attention, so they cross every stage cut."""

    def __init__(self, d=16, heads=2, layers=4, vocab=32):
        super().__init__()
        self.heads = heads
        self.emb = nn.Embedding(vocab, d)
        self.kv = nn.Linear(d, 2 * d)
        self.q = nn.ModuleList(nn.Linear(d, d) for _ in range(layers))
        self.o = nn.ModuleList(nn.Linear(d, d) for _ in range(layers))
        self.mlp = nn.ModuleList(nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
                                 for _ in range(layers))
        self.head = nn.Linear(d, vocab)

    def forward(self, ids):
        h = self.emb(ids)
        b, t, d = h.shape
        k, v = self.kv(h).view(b, t, 2, self.heads, d // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        for i in range(len(self.q)):
            q = self.q[i](h).view(b, t, self.heads, d // self.heads).transpose(1, 2)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            h = h + self.o[i](a.transpose(1, 2).reshape(b, t, d))
            h = h + self.mlp[i](h)
        return self.head(h)


def _lm_loss(out, target):
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))


def _shared_kv_case():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    return SharedKV(), torch.randint(0, 32, (8, 8), generator=g), torch.randint(0, 32, (8, 8), generator=g)


def _run_shared_kv_and_mismatch(rank, world):
    import traceback

    import autopar
    from autopar.runtime import distributed

    sgd = functools.partial(torch.optim.SGD, lr=0.1)
    model, ids, y = _shared_kv_case()
    pm = autopar.parallelize(model, (ids,), loss_fn=_lm_loss, optimizer=sgd,
                             plan=autopar.Plan(pp=2, schedule="zbv", num_microbatches=4), example_target=y)
    out = {"losses": [pm.step((ids,), y) for _ in range(2)], "state": pm.state_dict()}
    real = distributed.input_wires

    def longer(stage):  # rank 1 allocates a first activation twice as long as what rank 0 sends
        from autopar.runtime.boundary import Wire

        wires = real(stage)
        name = next(iter(wires))
        w = wires[name]
        wires[name] = Wire(shape=(2 * w.shape[0],) + w.shape[1:], full=(2 * w.full[0],) + w.full[1:], dtype=w.dtype,
                           broadcast=w.broadcast)
        return wires

    distributed.input_wires = longer if rank == 1 else real
    try:
        model, x, y = _case()
        autopar.parallelize(model, (x,), loss_fn=F.mse_loss, optimizer=sgd, example_target=y,
                            plan=autopar.Plan(pp=2, schedule="1f1b", num_microbatches=2))
        out["mismatch"] = None
    except ValueError:
        out["mismatch"] = traceback.format_exc()
    finally:
        distributed.input_wires = real
    return out


def test_shared_kv_across_cuts_and_a_boundary_mismatch_is_named_before_any_message():
    from tests.reference import assert_close_state, eager_reference

    per_rank = run_shared(_run_shared_kv_and_mismatch, 2, deadline_s=300)
    model, ids, y = _shared_kv_case()
    ref_losses, ref_state = eager_reference(model, (ids,), y, _lm_loss, functools.partial(torch.optim.SGD, lr=0.1),
                                            num_microbatches=4, steps=2)
    for r in range(2):
        res = per_rank[r]
        for got, want in zip(res["losses"], ref_losses):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
        assert_close_state(res["state"], ref_state)
        err = res["mismatch"]
        assert err is not None, f"rank {r} built despite the disagreeing receive buffer"
        # every rank names the boundary, the tensor, both sides' specs (the first dim doubled
        # on rank 1's side) and the line of this file that made the value
        assert "pipeline boundary stage 0 -> stage 1 (activations, rank 0 -> rank 1): tensor" in err, err
        sent = re.search(r"rank 0 sends \[(\d+)[\d, ]*\] (\w+) \((\d+) B\), rank 1 expects \[(\d+)[\d, ]*\] (\w+) "
                         r"\((\d+) B\)", err)
        assert sent and int(sent.group(4)) == 2 * int(sent.group(1)) and sent.group(2) == sent.group(5), err
        assert int(sent.group(6)) == 2 * int(sent.group(3)), err
        assert "made at " in err and "test_boundaries.py:" in err, err
