"""A small GPT for autopar examples, tests and capture benchmarks.

This is a deliberately plain decoder-only transformer (GPT-2 style, pre-LN) that is friendly
to ``torch.export.export(..., strict=False)``: static shapes, no data-dependent Python control
flow, no dropout, fp32.  It exercises the features the pipeline splitter must handle:

* a token embedding whose weight is TIED to the LM head (one ``Parameter`` used by the first
  and the last stage),
* a learned position embedding,
* ``n_layer`` identical pre-LN blocks in an ``nn.ModuleList`` named ``blocks`` (natural cut
  points), each with causal ``scaled_dot_product_attention`` and a GELU MLP.

``make_gpt(...)`` returns ``(model, (idx,), target, gpt_loss)``; with ``device="meta"`` it
builds the model and inputs on the meta device, for capture benchmarks of large configs
(e.g. 48 layers, d_model=1024) without allocating memory.

This module has no autopar imports so it can be used on its own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["GPTConfig", "GPT", "Block", "CausalSelfAttention", "MLP", "gpt_loss", "make_gpt"]


@dataclass
class GPTConfig:
    vocab_size: int = 256
    seq_len: int = 32
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 64


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        if cfg.d_model % cfg.n_head:
            raise ValueError(f"d_model={cfg.d_model} is not divisible by n_head={cfg.n_head}")
        self.n_head = cfg.n_head
        self.head_dim = cfg.d_model // cfg.n_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """``mask``: ``[B, 1, T, T]`` bool (True: may attend), else causal."""
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        q = q.view(b, t, self.n_head, self.head_dim).transpose(1, 2)
        k = k.view(b, t, self.n_head, self.head_dim).transpose(1, 2)
        v = v.view(b, t, self.n_head, self.head_dim).transpose(1, 2)
        if mask is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        y = y.transpose(1, 2).reshape(b, t, d)
        return self.proj(y)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.proj = nn.Linear(4 * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), mask)
        x = x + self.mlp(self.ln2(x))
        return x


class GPT(nn.Module):
    """Decoder-only transformer; ``forward(idx[B, T] int64) -> logits[B, T, vocab]``.

    Packed documents (``autopar.data.pack``): ``forward(input_ids, position_ids=...)`` embeds
    each token at its position in its document and lets it attend only to earlier tokens of
    the same document (a new document starts at every position 0); with ``labels`` (aligned
    with the tokens, -100 where none; shifted inside, as Hugging Face causal LMs do) it returns
    the mean next-token cross-entropy over the valid labels (``shift_labels``: the targets of
    every position, already shifted, as transformers' causal LMs take them)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied: one Parameter, two users
        self.init_weights()

    def init_weights(self) -> None:
        """GPT-2's init (also what ``autopar.parallelize`` runs for a model built on meta)."""
        std = 0.02
        # residual projections scaled down with depth (GPT-2)
        proj_std = std / math.sqrt(2 * max(self.cfg.n_layer, 1))
        for name, p in self.named_parameters():
            if p.dim() == 1:
                if name.endswith("bias"):
                    nn.init.zeros_(p)
                # LayerNorm weights stay at 1
            elif name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=proj_std)
            else:
                nn.init.normal_(p, mean=0.0, std=std)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, shift_labels: torch.Tensor | None = None) -> torch.Tensor:
        b, t = input_ids.shape
        mask = None
        if position_ids is None:
            pos = torch.arange(t, device=input_ids.device)
        else:
            pos = position_ids
            doc = (position_ids == 0).cumsum(-1)  # the document of every token
            # mask[b, q, k]: k <= q in q's document, written with index tensors as transformers'
            # mask functions are (what context parallelism rebuilds over the whole sequence)
            dev = input_ids.device
            bi, qi, ki = (torch.arange(b, device=dev)[:, None, None], torch.arange(t, device=dev)[None, :, None],
                          torch.arange(t, device=dev)[None, None, :])
            mask = ((doc[bi, qi] == doc[bi, ki]) & (ki <= qi))[:, None]
        x = self.wte(input_ids) + self.wpe(pos)
        for block in self.blocks:
            x = block(x, mask)
        logits = self.lm_head(self.ln_f(x))
        if labels is None:
            return logits
        if shift_labels is not None:  # the targets of every position (context parallelism's shards)
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), shift_labels.reshape(-1), ignore_index=-100)
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
                               ignore_index=-100)


def gpt_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean token-level cross entropy over the flattened ``[B*T, vocab]`` logits."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def make_gpt(
    n_layer: int = 4,
    d_model: int = 64,
    n_head: int = 4,
    vocab_size: int = 256,
    seq_len: int = 32,
    batch_size: int = 8,
    seed: int = 0,
    device=None,
):
    """Build a seeded GPT and a random batch.

    Returns ``(model, (idx,), target, gpt_loss)``; ``idx`` and ``target`` are int64
    ``[batch_size, seq_len]`` token ids drawn from the seed, ``target`` is ``idx`` shifted left
    by one with a fresh random token at the end (next-token prediction).  With
    ``device="meta"`` model and inputs live on the meta device (no storage, no values).
    """
    cfg = GPTConfig(vocab_size=vocab_size, seq_len=seq_len, n_layer=n_layer,
                    n_head=n_head, d_model=d_model)
    torch.manual_seed(seed)
    dev = torch.device(device) if device is not None else None
    if dev is not None and dev.type == "meta":
        with torch.device("meta"):
            model = GPT(cfg)
            idx = torch.empty(batch_size, seq_len, dtype=torch.long)
            target = torch.empty(batch_size, seq_len, dtype=torch.long)
        return model, (idx,), target, gpt_loss
    model = GPT(cfg)
    # data drawn on CPU from a dedicated generator so the values do not depend on the device
    gen = torch.Generator().manual_seed(seed + 1)
    tokens = torch.randint(0, vocab_size, (batch_size, seq_len + 1), generator=gen)
    idx, target = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    if dev is not None:
        model = model.to(dev)
        idx, target = idx.to(dev), target.to(dev)
    return model, (idx,), target, gpt_loss
