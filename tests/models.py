"""Test model zoo: small, seeded, export-friendly models with their inputs, target and loss.

Every factory ``make_<name>(seed=0) -> ModelCase`` builds its model under
``torch.manual_seed(seed)`` and draws the inputs/target from the same seed. All cases use a
global batch of ``BATCH = 8`` (divisible by dp * num_microbatches = 2 * 4), fp32, no dropout,
static shapes and no data-dependent Python control flow, so that
``torch.export.export(ModelWithLoss(model, loss_fn), (*inputs, target), strict=False)`` works.

Cases and what they exercise:

* ``gpt``      -- tied embedding / LM head (one Parameter used by first and last stage).
* ``llama``    -- RMSNorm, RoPE (non-persistent cos/sin buffers used by every layer), GQA,
                  SwiGLU, untied head.
* ``moe``      -- top-2 routing with topk + scatter into dense gates, dense expert compute,
                  auxiliary load-balance loss returned by the model and folded in by loss_fn.
* ``cnn_bn``   -- BatchNorm2d in training mode (buffer mutation: running stats and the
                  integer ``num_batches_tracked``); batch-coupled, so microbatching changes
                  the numbers.
* ``skip``     -- a long skip connection from the first layer into the last one.
* ``moe_ep``   -- two blocks of ``autopar.nn.MoE`` (capacity routing, one shared expert) for
                  expert parallelism; routing is skewed by construction so that the first half
                  of the batch sends no token to expert 3 (zero tokens for an expert on a rank).
* ``multi_io`` -- several inputs (float, float mask, int ids, a float input consumed only by
                  the last layer) and a dict output.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from autopar.examples import gpt as _gpt

BATCH = 8

__all__ = [
    "BATCH", "ModelCase", "ModelWithLoss", "export_case", "ALL_CASES",
    "make_gpt", "make_llama", "make_moe", "make_moe_ep", "make_cnn_bn", "make_skip", "make_multi_io",
    "memoized_capture",
]


def memoized_capture(capture, memo: dict | None = None):
    """``capture`` that captures each (model structure and config, tied and trainable parameters,
    parameter dtypes and devices, input shapes and dtypes, loss_fn) once (in ``memo``, or a new dict).

    Tests that run one zoo model under many plans (schedules, pp, dp) get the same captured
    graph for every plan: capture is deterministic, reads no parameter values, and
    split_stages / split_backward only read it, so this saves seconds per sub-case on 2 cores
    without changing what the sub-cases check. Not for code that rewrites the capture in
    place.
    """
    memo = {} if memo is None else memo

    def memoized(model, inputs, target=None, loss_fn=None, input_names=None, causal_masks=True):
        tensors = (*inputs, *([target] if target is not None else []))
        kinds = tuple(sorted({(str(t.dtype), t.device.type) for t in model.state_dict().values()}))
        # what repr() does not show but the graph depends on: a Hugging Face config (use_cache
        # changes the mask's graph), tied parameters (named_parameters lists a tie once) and
        # which parameters require grad (capture picks SDPA's layout by it)
        config = getattr(model, "config", None)
        config = config.to_json_string() if hasattr(config, "to_json_string") else None
        params = tuple((n, p.requires_grad) for n, p in model.named_parameters())
        key = (repr(model), config, params, kinds, tuple((tuple(t.shape), t.dtype) for t in tensors), loss_fn,
               input_names, causal_masks)
        if key not in memo:
            memo[key] = capture(model, inputs, target, loss_fn, input_names, causal_masks=causal_masks)
        return memo[key]

    memoized.memoized = True
    return memoized


@dataclass(frozen=True)
class ModelCase:
    name: str
    model: nn.Module
    inputs: tuple
    target: Any
    loss_fn: Optional[Callable[[Any, Any], torch.Tensor]]

    def loss(self, model: Optional[nn.Module] = None) -> torch.Tensor:
        """Full-batch forward + loss (on ``model`` if given, else on ``self.model``)."""
        m = self.model if model is None else model
        out = m(*self.inputs)
        return out if self.loss_fn is None else self.loss_fn(out, self.target)


class ModelWithLoss(nn.Module):
    """``forward(*inputs, target) -> scalar loss``; the module that gets captured."""

    def __init__(self, model: nn.Module, loss_fn):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, *args):
        *inputs, target = args
        out = self.model(*inputs)
        return out if self.loss_fn is None else self.loss_fn(out, target)


def export_case(case: ModelCase, decompose: bool = True):
    """Capture ``case`` (model + loss) with non-strict torch.export."""
    ep = torch.export.export(ModelWithLoss(case.model, case.loss_fn),
                             (*case.inputs, case.target), strict=False)
    return ep.run_decompositions({}) if decompose else ep


def _ce(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


# --------------------------------------------------------------------------------------------
# gpt
# --------------------------------------------------------------------------------------------

def make_gpt(seed: int = 0) -> ModelCase:
    model, inputs, target, loss_fn = _gpt.make_gpt(
        n_layer=4, d_model=32, n_head=4, vocab_size=256, seq_len=32, batch_size=BATCH, seed=seed)
    return ModelCase("gpt", model, inputs, target, loss_fn)


# --------------------------------------------------------------------------------------------
# llama
# --------------------------------------------------------------------------------------------

class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [B, H, T, Dh]; cos/sin: [T, Dh]
    return x * cos + _rotate_half(x) * sin


class LlamaAttention(nn.Module):
    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int):
        super().__init__()
        self.n_heads, self.n_kv_heads = n_heads, n_kv_heads
        self.head_dim = d_model // n_heads
        self.wq = nn.Linear(d_model, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(d_model, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(d_model, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, d_model, bias=False)

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = _apply_rope(q, cos, sin), _apply_rope(k, cos, sin)
        rep = self.n_heads // self.n_kv_heads
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class SwiGLU(nn.Module):
    def __init__(self, d_model: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(d_model, hidden, bias=False)
        self.w3 = nn.Linear(d_model, hidden, bias=False)
        self.w2 = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class LlamaBlock(nn.Module):
    def __init__(self, d_model, n_heads, n_kv_heads, hidden):
        super().__init__()
        self.attn_norm = RMSNorm(d_model)
        self.attn = LlamaAttention(d_model, n_heads, n_kv_heads)
        self.ffn_norm = RMSNorm(d_model)
        self.ffn = SwiGLU(d_model, hidden)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.ffn(self.ffn_norm(x))


class Llama(nn.Module):
    def __init__(self, vocab_size=256, seq_len=32, d_model=32, n_layers=4, n_heads=4,
                 n_kv_heads=2, hidden=64, rope_theta=10000.0):
        super().__init__()
        head_dim = d_model // n_heads
        self.tok_embeddings = nn.Embedding(vocab_size, d_model)
        self.layers = nn.ModuleList(LlamaBlock(d_model, n_heads, n_kv_heads, hidden)
                                    for _ in range(n_layers))
        self.norm = RMSNorm(d_model)
        self.output = nn.Linear(d_model, vocab_size, bias=False)  # untied
        inv_freq = 1.0 / (rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        freqs = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)  # [T, Dh/2]
        emb = torch.cat((freqs, freqs), dim=-1)                                     # [T, Dh]
        self.register_buffer("rope_cos", emb.cos(), persistent=False)
        self.register_buffer("rope_sin", emb.sin(), persistent=False)
        for name, p in self.named_parameters():
            if p.dim() > 1:
                nn.init.normal_(p, std=0.02)

    def forward(self, idx):
        t = idx.shape[1]
        cos, sin = self.rope_cos[:t], self.rope_sin[:t]
        h = self.tok_embeddings(idx)
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.output(self.norm(h))


def make_llama(seed: int = 0) -> ModelCase:
    torch.manual_seed(seed)
    vocab, seq = 256, 32
    model = Llama(vocab_size=vocab, seq_len=seq)
    tokens = torch.randint(0, vocab, (BATCH, seq + 1))
    return ModelCase("llama", model, (tokens[:, :-1].contiguous(),),
                     tokens[:, 1:].contiguous(), _ce)


# --------------------------------------------------------------------------------------------
# moe
# --------------------------------------------------------------------------------------------

class Expert(nn.Module):
    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, d)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class Top2MoE(nn.Module):
    """Top-2 MoE with dense compute: every expert sees every token, gates are zero off top-2.

    Returns ``(y, aux)`` where ``aux[B]`` is a per-sequence Switch-style load-balance loss
    (computed per sequence so the model stays free of batch coupling: the mean over the batch
    is the mean over microbatch means).
    """

    def __init__(self, d: int, hidden: int, n_experts: int = 4, k: int = 2):
        super().__init__()
        self.n_experts, self.k = n_experts, k
        self.norm = nn.LayerNorm(d)
        self.router = nn.Linear(d, n_experts, bias=False)
        self.experts = nn.ModuleList(Expert(d, hidden) for _ in range(n_experts))

    def forward(self, x):                                  # x: [B, T, d]
        h = self.norm(x)
        probs = F.softmax(self.router(h), dim=-1)          # [B, T, E]
        topv, topi = probs.topk(self.k, dim=-1)            # [B, T, k]
        topv = topv / topv.sum(-1, keepdim=True)
        gates = torch.zeros_like(probs).scatter(-1, topi, topv)        # [B, T, E]
        y = x
        for e, expert in enumerate(self.experts):
            y = y + gates[..., e:e + 1] * expert(h)
        routed = torch.zeros_like(probs).scatter(-1, topi, 1.0)        # hard assignment
        frac = routed.mean(dim=1) / self.k                 # [B, E] fraction of slots per expert
        mean_p = probs.mean(dim=1)                         # [B, E]
        aux = self.n_experts * (frac * mean_p).sum(-1)     # [B]; 1.0 when balanced
        return y, aux


class MoEModel(nn.Module):
    def __init__(self, d_in=16, d=32, hidden=64, n_out=8, n_experts=4):
        super().__init__()
        self.inp = nn.Linear(d_in, d)
        self.moe1 = Top2MoE(d, hidden, n_experts)
        self.mid = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, d), nn.GELU())
        self.moe2 = Top2MoE(d, hidden, n_experts)
        self.mid2 = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, d), nn.GELU())
        self.head = nn.Linear(d, n_out)

    def forward(self, x):
        h = self.inp(x)
        h, aux1 = self.moe1(h)
        h = h + self.mid(h)
        h, aux2 = self.moe2(h)
        h = h + self.mid2(h)
        return self.head(h), aux1 + aux2


MOE_AUX_WEIGHT = 0.01


def moe_loss(out, target):
    y, aux = out
    return F.mse_loss(y, target) + MOE_AUX_WEIGHT * aux.mean()


def make_moe(seed: int = 0) -> ModelCase:
    torch.manual_seed(seed)
    model = MoEModel()
    x = torch.randn(BATCH, 8, 16)
    target = torch.randn(BATCH, 8, 8)
    return ModelCase("moe", model, (x,), target, moe_loss)


# --------------------------------------------------------------------------------------------
# cnn_bn
# --------------------------------------------------------------------------------------------

def _conv_bn(cin, cout):
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False),
                         nn.BatchNorm2d(cout), nn.ReLU())


class CNNBN(nn.Module):
    def __init__(self, n_classes=10):
        super().__init__()
        self.block1 = _conv_bn(3, 8)
        self.block2 = _conv_bn(8, 16)
        self.pool = nn.MaxPool2d(2)               # 16x16 -> 8x8
        self.block3 = _conv_bn(16, 16)
        self.block4 = _conv_bn(16, 16)
        self.head = nn.Linear(16, n_classes)

    def forward(self, x):
        x = self.block2(self.block1(x))
        x = self.pool(x)
        x = self.block4(self.block3(x))
        return self.head(x.mean(dim=(2, 3)))      # global average pool


def make_cnn_bn(seed: int = 0) -> ModelCase:
    torch.manual_seed(seed)
    model = CNNBN().train()
    x = torch.randn(BATCH, 3, 16, 16)
    target = torch.randint(0, 10, (BATCH,))
    return ModelCase("cnn_bn", model, (x,), target, F.cross_entropy)


# --------------------------------------------------------------------------------------------
# skip
# --------------------------------------------------------------------------------------------

class SkipMLP(nn.Module):
    """``n_layers`` Linear layers; the first layer's output is added to the last one's input."""

    def __init__(self, d_in=16, d=32, d_out=4, n_layers=8):
        super().__init__()
        assert n_layers >= 6
        self.first = nn.Linear(d_in, d)
        self.layers = nn.ModuleList(nn.Linear(d, d) for _ in range(n_layers - 2))
        self.last = nn.Linear(d, d_out)

    def forward(self, x):
        h0 = torch.tanh(self.first(x))
        h = h0
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return self.last(h + h0)                  # long skip: first layer -> last layer


def make_skip(seed: int = 0) -> ModelCase:
    torch.manual_seed(seed)
    model = SkipMLP()
    x = torch.randn(BATCH, 16)
    target = torch.randn(BATCH, 4)
    return ModelCase("skip", model, (x,), target, F.mse_loss)


# --------------------------------------------------------------------------------------------
# multi_io
# --------------------------------------------------------------------------------------------

class MultiIO(nn.Module):
    """``forward(x[B,T,d_in] f32, mask[B,T] f32, cls[B] i64, extra[B,d_extra] f32)
    -> {"logits": [B, n_classes], "aux": [B]}``. ``extra`` is consumed only by the last layer."""

    def __init__(self, d_in=16, d=32, n_cls_ids=5, d_extra=6, n_classes=5, n_layers=4):
        super().__init__()
        self.inp = nn.Linear(d_in, d)
        self.cls_emb = nn.Embedding(n_cls_ids, d)
        self.layers = nn.ModuleList(nn.Sequential(nn.LayerNorm(d), nn.Linear(d, d), nn.GELU())
                                    for _ in range(n_layers))
        self.pre_head = nn.Linear(d, d)
        self.head = nn.Linear(d + d_extra, n_classes)

    def forward(self, x, mask, cls, extra):
        h = self.inp(x) + self.cls_emb(cls)[:, None, :]
        for layer in self.layers:
            h = h + layer(h)
        m = mask[..., None]
        pooled = (h * m).sum(1) / m.sum(1).clamp_min(1.0)      # masked mean over T
        z = torch.tanh(self.pre_head(pooled))
        logits = self.head(torch.cat([z, extra], dim=-1))      # extra enters only here
        aux = z.pow(2).mean(-1)                                # per-sample activation penalty
        return {"logits": logits, "aux": aux}


def multi_io_loss(out, target):
    return F.cross_entropy(out["logits"], target) + 0.1 * out["aux"].mean()


def make_multi_io(seed: int = 0) -> ModelCase:
    torch.manual_seed(seed)
    model = MultiIO()
    T = 6
    x = torch.randn(BATCH, T, 16)
    mask = (torch.rand(BATCH, T) < 0.7).float()
    mask[:, 0] = 1.0                                           # every row has a valid token
    cls = torch.randint(0, 5, (BATCH,))
    extra = torch.randn(BATCH, 6)
    target = torch.randint(0, 5, (BATCH,))
    return ModelCase("multi_io", model, (x, mask, cls, extra), target, multi_io_loss)


class MoEBlocksNet(nn.Module):
    """linear -> n_layers x (h + MoE(h)) -> head; returns (out, summed aux loss)."""

    def __init__(self, d_in=6, d=16, hidden=24, n_experts=4, n_layers=2, n_out=3):
        super().__init__()
        from autopar.nn import MoE

        self.inp = nn.Linear(d_in, d)
        self.layers = nn.ModuleList(MoE(d, hidden, n_experts, 2, n_shared_experts=1, capacity_factor=1.0,
                                        aux_loss_weight=0.1) for _ in range(n_layers))
        self.head = nn.Linear(d, n_out)

    def forward(self, x):
        h = self.inp(x)
        aux = h.new_zeros(())
        for moe in self.layers:
            y, a = moe(h)
            h = h + y
            aux = aux + a
        return self.head(h), aux


def moe_ep_loss(out, target):
    y, aux = out
    return F.mse_loss(y, target) + aux


def make_moe_ep(seed: int = 0) -> ModelCase:
    torch.manual_seed(seed)
    model = MoEBlocksNet()
    with torch.no_grad():
        # h[..., 0] copies x[..., 0] (+2 on the first half of the batch, -2 on the second);
        # every router scores expert 3 at -4 * h0: the first half never picks it
        model.inp.weight[0].zero_()
        model.inp.weight[0, 0] = 1.0
        model.inp.bias[0] = 0.0
        for moe in model.layers:
            moe.router.weight[3, 0] = -4.0
    x = torch.randn(BATCH, 6, 6)
    x[: BATCH // 2, :, 0] = 2.0
    x[BATCH // 2:, :, 0] = -2.0
    return ModelCase("moe_ep", model, (x,), torch.randn(BATCH, 6, 3), moe_ep_loss)


ALL_CASES: dict[str, Callable[..., ModelCase]] = {
    "gpt": make_gpt,
    "llama": make_llama,
    "moe": make_moe,
    "moe_ep": make_moe_ep,
    "cnn_bn": make_cnn_bn,
    "skip": make_skip,
    "multi_io": make_multi_io,
}


# --------------------------------------------------------------------------------------------
# grad_modes (not in ALL_CASES: tests/integration/test_grad_mode_local.py and tests/dist run it)
# --------------------------------------------------------------------------------------------

GRAD_MODES = ("no_grad", "enable_inside", "set_grad_enabled", "inference_mode")


class GradModeMLP(nn.Module):
    """A chain of Linear layers with one region run without gradient (issue 52), in one of the
    ``GRAD_MODES`` spellings. ``only_there`` is used inside the region alone (eager gives it no
    gradient); ``mid`` is used inside the region and again after it (a gradient from the second
    use only); ``enable_inside`` turns gradients back on for ``inner`` inside the region."""

    def __init__(self, variant: str, d: int = 16, d_out: int = 4):
        super().__init__()
        assert variant in GRAD_MODES, variant
        self.variant = variant
        self.first = nn.Linear(d, d)
        self.mid = nn.Linear(d, d)
        self.only_there = nn.Linear(d, d)
        self.inner = nn.Linear(d, d)
        self.after = nn.ModuleList(nn.Linear(d, d) for _ in range(3))
        self.head = nn.Linear(d, d_out)

    def forward(self, x):
        z = self.first(x)
        if self.variant == "no_grad":
            with torch.no_grad():
                z = self.mid(torch.tanh(z)) + self.only_there(x)
        elif self.variant == "enable_inside":
            with torch.no_grad():
                t = self.mid(torch.tanh(z)) + self.only_there(x)
                with torch.enable_grad():
                    z = self.inner(torch.tanh(t)) + z  # gradient to inner and (through z) first
        elif self.variant == "set_grad_enabled":
            torch.set_grad_enabled(False)
            z = self.mid(torch.tanh(z)) + self.only_there(x)
            torch.set_grad_enabled(True)
        else:
            with torch.inference_mode():
                z = self.mid(torch.tanh(z)) + self.only_there(x)
        for layer in self.after:
            z = layer(torch.tanh(z))
        z = self.mid(torch.tanh(z))
        return self.head(z)


def make_grad_modes(seed: int = 0, variant: str = "no_grad") -> ModelCase:
    torch.manual_seed(seed)
    model = GradModeMLP(variant)
    x = torch.randn(BATCH, 16)
    target = torch.randn(BATCH, 4)
    return ModelCase(f"grad_modes_{variant}", model, (x,), target, F.mse_loss)
