"""A Llama-3 style decoder (optionally Mixtral / DeepSeek-V3 style), export-friendly.

Plain, pre-norm decoder-only transformer that ``torch.export.export(..., strict=False)``
captures as one static graph (static shapes, no data-dependent Python control flow):

* ``tok_embeddings``, then ``n_layers`` blocks in an ``nn.ModuleList`` named ``layers``, a final
  RMSNorm ``norm`` and an untied output head ``output``;
* each block: ``attention_norm`` -> ``attention`` -> residual, ``ffn_norm`` -> ``feed_forward``
  -> residual;
* RMSNorm computed in fp32; RoPE with precomputed cos/sin tables held by the model as
  non-persistent buffers ``freqs_cos`` / ``freqs_sin`` ``[seq_len, rope_dim / 2]`` and passed to
  every layer (rotate-half layout; equivalent to Meta's interleaved complex form up to a fixed
  permutation of the q/k projection rows);
* attention (``attention="gqa"``): grouped-query attention, k/v heads repeated with
  ``repeat_interleave`` to the query heads, ``F.scaled_dot_product_attention(is_causal=True)``;
* attention (``attention="mla"``): DeepSeek-V2/V3 multi-head latent attention: low-rank query
  (``wq_a`` -> ``q_norm`` -> ``wq_b``), compressed joint kv (``wkv_a`` -> ``kv_norm`` ->
  ``wkv_b``) plus one shared decoupled RoPE key; per head ``qk_nope_head_dim +
  qk_rope_head_dim`` for q/k and ``v_head_dim`` for v (padded to the q/k width for SDPA so it runs as a flash kernel);
* feed-forward: SwiGLU of width ``ffn_hidden``, or, when ``n_experts > 0`` (from layer
  ``n_dense_layers`` on), the MoE of ``autopar.nn``: capacity-based (``capacity_factor`` slots
  per expert relative to balanced routing), or dropless with ``capacity_factor=None`` (the
  experts are one ``autopar::moe_dispatch`` op computing every routed assignment).

``Llama.forward(tokens[B, T] int64)`` returns the logits ``[B, T, vocab]`` for a dense model and
``(logits, aux)`` for an MoE model, ``aux`` being the sum of the layers' (already weighted)
load-balance losses; ``llama_loss`` handles both (cross entropy in fp32, plus ``aux``).

This module has no autopar imports so it can be used on its own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

try:
    from autopar.nn import MoE, SwiGLU
except ImportError:  # run as a loose script next to moe.py
    from moe import MoE, SwiGLU  # type: ignore[no-redef]

__all__ = ["LlamaConfig", "Llama", "RMSNorm", "Attention", "MLAttention", "TransformerBlock",
           "llama_loss", "rope_tables", "apply_rope", "make_llama"]


@dataclass
class LlamaConfig:
    vocab_size: int = 256
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_hidden: int = 172
    seq_len: int = 32
    rope_theta: float = 500000.0
    norm_eps: float = 1e-5
    # Mixture of experts (0 experts: dense). Layers [0, n_dense_layers) keep the dense FFN.
    n_experts: int = 0
    top_k: int = 2
    expert_hidden: int = 0
    n_shared_experts: int = 0
    n_dense_layers: int = 0
    capacity_factor: float | None = 1.25  # None: dropless MoE
    aux_loss_weight: float = 0.01
    score_func: str = "softmax"
    norm_topk_prob: bool = True
    route_scale: float = 1.0
    n_expert_groups: int = 1
    topk_groups: int = 1
    selection_bias: bool = False
    # Attention: "gqa" (Llama, Mixtral) or "mla" (DeepSeek-V2/V3; q_lora_rank 0 = full-rank q).
    attention: str = "gqa"
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def rope_dim(self) -> int:
        return self.qk_rope_head_dim if self.attention == "mla" else self.head_dim

    def is_moe_layer(self, layer_id: int) -> bool:
        return self.n_experts > 0 and layer_id >= self.n_dense_layers


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return xf.type_as(x) * self.weight


def rope_tables(rope_dim: int, seq_len: int, theta: float, device=None):
    """``(cos, sin)``, each ``[seq_len, rope_dim // 2]`` fp32."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, rope_dim, 2, device=device, dtype=torch.float32) / rope_dim))
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x[B, H, T, r]`` by the tables ``[T, r/2]`` (rotate-half layout)."""
    x1, x2 = x.chunk(2, dim=-1)
    cos = cos.to(x.dtype)
    sin = sin.to(x.dtype)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class Attention(nn.Module):
    """Grouped-query attention with RoPE; causal SDPA."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        if cfg.d_model % cfg.n_heads or cfg.n_heads % cfg.n_kv_heads:
            raise ValueError(f"need n_heads | d_model and n_kv_heads | n_heads; got d_model={cfg.d_model}, "
                             f"n_heads={cfg.n_heads}, n_kv_heads={cfg.n_kv_heads}")
        self.n_heads = cfg.n_heads
        self.n_kv_heads = cfg.n_kv_heads
        self.head_dim = cfg.head_dim
        self.wq = nn.Linear(cfg.d_model, cfg.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.d_model, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.d_model, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * self.head_dim, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)
        # grouped-query attention inside SDPA (query head h reads key/value head h // (n_heads /
        # n_kv_heads)): the key/value heads are not repeated into n_heads copies, nor kept so
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.n_heads != self.n_kv_heads)
        return self.wo(y.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim))


class MLAttention(nn.Module):
    """DeepSeek multi-head latent attention (training form: k/v up-projected, no absorption).

    Parameters (DeepSeek-V3 names): ``wq_a [q_lora, d]``, ``q_norm``, ``wq_b [H*(nope+rope), q_lora]``
    (or ``wq [H*(nope+rope), d]`` when ``q_lora_rank == 0``), ``wkv_a [kv_lora+rope, d]``,
    ``kv_norm``, ``wkv_b [H*(nope+v), kv_lora]``, ``wo [d, H*v]``.  The rope part of k is one
    head shared by all query heads.  Softmax scale ``1/sqrt(nope+rope)`` (YaRN's mscale, which
    only matters for context extension, is left out).
    """

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.nope = cfg.qk_nope_head_dim
        self.rope = cfg.qk_rope_head_dim
        self.v_dim = cfg.v_head_dim
        self.kv_lora_rank = cfg.kv_lora_rank
        qk_dim = self.nope + self.rope
        if cfg.q_lora_rank:
            self.wq_a = nn.Linear(cfg.d_model, cfg.q_lora_rank, bias=False)
            self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.norm_eps)
            self.wq_b = nn.Linear(cfg.q_lora_rank, cfg.n_heads * qk_dim, bias=False)
        else:
            self.wq = nn.Linear(cfg.d_model, cfg.n_heads * qk_dim, bias=False)
        self.wkv_a = nn.Linear(cfg.d_model, cfg.kv_lora_rank + self.rope, bias=False)
        self.kv_norm = RMSNorm(cfg.kv_lora_rank, cfg.norm_eps)
        self.wkv_b = nn.Linear(cfg.kv_lora_rank, cfg.n_heads * (self.nope + self.v_dim), bias=False)
        self.wo = nn.Linear(cfg.n_heads * self.v_dim, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.n_heads
        q = self.wq_b(self.q_norm(self.wq_a(x))) if hasattr(self, "wq_a") else self.wq(x)
        q = q.view(b, t, h, self.nope + self.rope).transpose(1, 2)
        q_nope, q_pe = q.split([self.nope, self.rope], dim=-1)
        q = torch.cat([q_nope, apply_rope(q_pe, cos, sin)], dim=-1)

        kv, k_pe = self.wkv_a(x).split([self.kv_lora_rank, self.rope], dim=-1)
        k_pe = apply_rope(k_pe.view(b, t, 1, self.rope).transpose(1, 2), cos, sin)  # [B, 1, T, rope]
        kv = self.wkv_b(self.kv_norm(kv)).view(b, t, h, self.nope + self.v_dim).transpose(1, 2)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_pe.expand(b, h, t, self.rope)], dim=-1)
        qk_dim = self.nope + self.rope
        if self.v_dim < qk_dim:
            # flash kernels want one head width for q, k and v: pad v, attend, slice (as
            # torchtitan does); without it SDPA falls back to the math path and keeps T x T scores
            v = F.pad(v, (0, qk_dim - self.v_dim))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)[..., : self.v_dim]  # [B, H, T, v_dim]
        return self.wo(y.transpose(1, 2).reshape(b, t, h * self.v_dim))


class TransformerBlock(nn.Module):
    """Pre-norm block; ``forward(x, cos, sin)`` returns ``x`` (dense FFN) or ``(x, aux)`` (MoE)."""

    def __init__(self, layer_id: int, cfg: LlamaConfig):
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attention = MLAttention(cfg) if cfg.attention == "mla" else Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.is_moe = cfg.is_moe_layer(layer_id)
        if self.is_moe:
            self.feed_forward = MoE(
                cfg.d_model, cfg.expert_hidden, cfg.n_experts, cfg.top_k,
                n_shared_experts=cfg.n_shared_experts, capacity_factor=cfg.capacity_factor,
                aux_loss_weight=cfg.aux_loss_weight, score_func=cfg.score_func,
                norm_topk_prob=cfg.norm_topk_prob, route_scale=cfg.route_scale,
                n_groups=cfg.n_expert_groups, topk_groups=cfg.topk_groups,
                selection_bias=cfg.selection_bias)
        else:
            self.feed_forward = SwiGLU(cfg.d_model, cfg.ffn_hidden)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        x = x + self.attention(self.attention_norm(x), cos, sin)
        if self.is_moe:
            y, aux = self.feed_forward(self.ffn_norm(x))
            return x + y, aux
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    """``forward(tokens[B, T] int64)`` -> logits ``[B, T, vocab]`` (dense) or ``(logits, aux)`` (MoE)."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        if cfg.attention not in ("gqa", "mla"):
            raise ValueError(f"attention must be 'gqa' or 'mla', got {cfg.attention!r}")
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(TransformerBlock(i, cfg) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.output = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        cos, sin = rope_tables(cfg.rope_dim, cfg.seq_len, cfg.rope_theta)
        self.register_buffer("freqs_cos", cos, persistent=False)
        self.register_buffer("freqs_sin", sin, persistent=False)
        self.init_weights()

    @property
    def is_moe(self) -> bool:
        return any(layer.is_moe for layer in self.layers)

    def reset_rope(self) -> None:
        """Recompute the RoPE tables in place (after ``to_empty`` from the meta device)."""
        cos, sin = rope_tables(self.cfg.rope_dim, self.cfg.seq_len, self.cfg.rope_theta,
                               device=self.freqs_cos.device)
        with torch.no_grad():
            self.freqs_cos.copy_(cos)
            self.freqs_sin.copy_(sin)

    def init_weights(self) -> None:
        """Weights (normal, residual projections scaled with depth; grouped experts and norms keep
        their modules' own init) and the RoPE tables: what ``autopar.parallelize`` runs for a
        meta model, after every module's ``reset_parameters()``."""
        self.reset_rope()
        std = 0.02
        out_std = std / math.sqrt(2 * max(self.cfg.n_layers, 1))
        for name, p in self.named_parameters():
            if p.dim() < 2 or ".experts." in name:
                continue  # norm weights stay 1; grouped experts keep their own init
            nn.init.normal_(p, mean=0.0, std=out_std if name.endswith(("wo.weight", "w2.weight")) else std)

    def forward(self, tokens: torch.Tensor):
        t = tokens.shape[1]
        cos, sin = self.freqs_cos[:t], self.freqs_sin[:t]
        x = self.tok_embeddings(tokens)
        aux = None
        for layer in self.layers:
            out = layer(x, cos, sin)
            if isinstance(out, tuple):
                x, a = out
                aux = a if aux is None else aux + a
            else:
                x = out
        logits = self.output(self.norm(x))
        return logits if aux is None else (logits, aux)


def llama_loss(out, target: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy (fp32) of ``out`` = logits or ``(logits, aux)``, plus ``aux``."""
    aux = None
    if isinstance(out, tuple):
        out, aux = out
    loss = F.cross_entropy(out.reshape(-1, out.shape[-1]).float(), target.reshape(-1))
    return loss if aux is None else loss + aux


def make_llama(cfg: LlamaConfig | None = None, batch_size: int = 8, seed: int = 0, device=None):
    """Build a seeded ``Llama(cfg)`` and a random batch: ``(model, (tokens,), target, llama_loss)``.

    With ``device="meta"`` model and tensors are built on the meta device (no storage).
    """
    cfg = cfg or LlamaConfig()
    torch.manual_seed(seed)
    dev = torch.device(device) if device is not None else None
    if dev is not None and dev.type == "meta":
        with torch.device("meta"):
            model = Llama(cfg)
            tokens = torch.empty(batch_size, cfg.seq_len, dtype=torch.long)
            target = torch.empty(batch_size, cfg.seq_len, dtype=torch.long)
        return model, (tokens,), target, llama_loss
    model = Llama(cfg)
    gen = torch.Generator().manual_seed(seed + 1)
    data = torch.randint(0, cfg.vocab_size, (batch_size, cfg.seq_len + 1), generator=gen)
    tokens, target = data[:, :-1].contiguous(), data[:, 1:].contiguous()
    if dev is not None:
        model, tokens, target = model.to(dev), tokens.to(dev), target.to(dev)
    return model, (tokens,), target, llama_loss
