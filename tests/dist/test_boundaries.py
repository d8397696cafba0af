"""Stage boundaries of every kind over gloo (issue 15 item 1): a model whose every pipeline
boundary carries a broadcast bool mask, a broadcast buffer and a broadcast parameter, a
transposed and a channels-last activation, int64 ids, a 0-dim tensor with a gradient and a
value without one, all made before the first cut and read after the last (so they cross
every boundary and reach several later stages). pp=2 with zbv (4 stages in a V) and 1f1b
match eager PyTorch after two SGD steps."""
import functools

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
