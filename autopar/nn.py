"""Layers autopar knows how to parallelize beyond pipeline and data parallelism.

A capacity-based, static-shape token-choice Mixture-of-Experts block (GShard / Switch style).

``MoE(d_model, expert_hidden, n_experts, top_k, ...)`` is usable both for real training at
small sizes and for planning huge models on the meta device: every shape depends only on the
input *shape*, never on routing decisions, so ``torch.export.export(strict=False)`` captures it
as one static graph (no ``.item()``, no ``nonzero``, no boolean indexing).

Routing (one token = one row of the flattened ``[N, d]`` input):

1. router ``Linear(d, E)`` -> scores: ``softmax`` (Mixtral / Switch) or ``sigmoid`` (DeepSeek-V3,
   with an optional selection-only bias buffer and group-limited routing);
2. ``topk`` -> ``top_k`` expert ids and gate values per token (optionally renormalised over the
   selected experts, optionally scaled by ``route_scale``);
3. capacity ``C = min(N, ceil(N * top_k / E * capacity_factor))`` slots per expert.  The
   ``(token, slot)`` assignments are ranked inside their expert by a cumulative sum over the
   one-hot of the expert ids, taken slot-major (all first choices before any second choice, as
   in GShard); assignments ranked ``>= C`` are dropped: their gate contributes nothing;
4. dispatch: every buffer slot ``(e, c)`` learns which token fills it (a scatter of token ids;
   dropped assignments go to a dummy slot that is sliced off), and the ``[E, C, d]`` buffer is
   gathered from the tokens (an empty slot reads an all-zero pad row);
5. experts: SwiGLU with batched weights ``w1, w3 [E, d, h]`` and ``w2 [E, h, d]`` computed
   with ``torch.bmm`` on ``[E, C, d]``, i.e. ``2 * 3 * E * C * d * h`` FLOPs forward, which is
   ``top_k * capacity_factor`` dense FFNs of width ``h`` per token (not ``E`` of them);
6. combine: each slot's output times its gate is index-added back to its token;
7. shared experts (DeepSeek): one plain SwiGLU of width ``n_shared_experts * expert_hidden``
   applied to every token and added.

``forward(x[..., d]) -> (y[..., d], aux)`` where ``aux`` is the Switch load-balance loss
``aux_loss_weight * E * sum_e f_e * P_e`` (``f_e``: fraction of the ``N * top_k`` assignments
routed to expert ``e`` before dropping, ``P_e``: mean routing probability of ``e``); it equals
``aux_loss_weight`` under perfectly balanced routing.  The model adds it into its loss.

``forward`` is ``route`` -> ``dispatch`` -> ``compute_experts`` -> ``combine`` (+ ``balance_loss``);
the expert-parallel form (``autopar.passes.expert_parallel``) overrides ``compute_experts`` only,
so routing, capacity, dropping and combining stay this module's.

**Dropless mode** (``capacity_factor=None``): steps 3-6 become one graph op
(``autopar.passes.moe_dispatch``) with a static ``[N, d]`` output whose inside is dynamic: every
``(token, choice)`` assignment is computed by its expert (no drops, no padding), ``GroupedExperts``
running each expert's GEMMs on exactly the rows routed to it; under expert parallelism the same op
moves only the routed rows (uneven all-to-alls sized by the exchanged counts). The output equals
``sum_j gate[n, j] * expert_{id[n, j]}(x[n])`` for every token, the same as a static-capacity block
whose capacity never overflows.

``MoE`` is a token-choice top-k block (static capacity, or dropless); ``GroupedExperts`` holds the
``E`` experts' SwiGLU weights batched; ``SwiGLU`` is the plain FFN used for shared experts.
This module imports nothing else of autopar but the dispatch op.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from autopar.passes import moe_dispatch

__all__ = ["SwiGLU", "GroupedExperts", "MoE", "expert_capacity"]


def expert_capacity(num_tokens: int, n_experts: int, top_k: int, capacity_factor: float) -> int:
    """Slots per expert: ``min(N, ceil(N * top_k / E * capacity_factor))`` (at least 1).

    An expert can never receive more than ``N`` assignments (a token picks distinct experts),
    so a capacity above ``N`` would only add padding.
    """
    cap = math.ceil(num_tokens * top_k / n_experts * capacity_factor)
    return max(1, min(num_tokens, cap))


class SwiGLU(nn.Module):
    """``w2(silu(w1 x) * w3 x)``, no biases (Llama / Mixtral / DeepSeek FFN)."""

    def __init__(self, d_model: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(d_model, hidden, bias=False)
        self.w2 = nn.Linear(hidden, d_model, bias=False)
        self.w3 = nn.Linear(d_model, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class GroupedExperts(nn.Module):
    """``E`` SwiGLU experts with batched weights; ``forward(x[E, C, d]) -> [E, C, d]``."""

    def __init__(self, d_model: int, hidden: int, n_experts: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, d_model, hidden))
        self.w3 = nn.Parameter(torch.empty(n_experts, d_model, hidden))
        self.w2 = nn.Parameter(torch.empty(n_experts, hidden, d_model))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        d, h = self.w1.shape[1], self.w1.shape[2]
        # the same scale nn.Linear's default init would give each expert's matrices
        for w, fan_in in ((self.w1, d), (self.w3, d), (self.w2, h)):
            bound = 1.0 / math.sqrt(fan_in)
            nn.init.uniform_(w, -bound, bound)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.bmm(F.silu(torch.bmm(x, self.w1)) * torch.bmm(x, self.w3), self.w2)

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert ``e`` alone on ``x[..., d]`` (for references and tests)."""
        return (F.silu(x @ self.w1[e]) * (x @ self.w3[e])) @ self.w2[e]

    @staticmethod
    def run_rows(params: dict, rows: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                 counts: list[int]) -> torch.Tensor:
        """Dropless form: row ``m`` of ``rows [M, d]`` through expert ``ids[m]`` (of the experts
        in ``params``: ``w1, w3 [El, d, h]``, ``w2 [El, h, d]``) times ``weights[m]``;
        ``counts[e]``: the rows of expert ``e``. Each expert's GEMMs run on the contiguous group
        of its rows (sorted by expert)."""
        w1, w3, w2 = params["w1"], params["w3"], params["w2"]
        order = torch.argsort(ids, stable=True)
        groups = rows.index_select(0, order).split(counts)
        w1, w3, w2 = w1.unbind(0), w3.unbind(0), w2.unbind(0)  # one backward node per weight, not one per expert
        out = torch.cat([(F.silu(g @ w1[e]) * (g @ w3[e])) @ w2[e] for e, g in enumerate(groups)])
        out = torch.empty_like(out).index_copy_(0, order, out)
        return out * weights.to(out.dtype).unsqueeze(1)


class MoE(nn.Module):
    """Token-choice top-k MoE with a static per-expert capacity; ``forward(x) -> (y, aux)``.

    Args:
      d_model, expert_hidden, n_experts, top_k: sizes.
      n_shared_experts: DeepSeek-style always-on experts, fused into one SwiGLU of width
        ``n_shared_experts * expert_hidden`` (``shared_expert``); 0 for none.
      capacity_factor: slots per expert relative to perfectly balanced routing (see
        ``expert_capacity``); ``n_experts / top_k`` or more never drops a token.
      aux_loss_weight: scale of the returned load-balance loss.
      score_func: ``"softmax"`` (Mixtral, Switch) or ``"sigmoid"`` (DeepSeek-V3).
      norm_topk_prob: renormalise the selected gates to sum to 1 (Mixtral, DeepSeek-V3: True;
        Switch: False).
      route_scale: multiplies the gates (DeepSeek-V3: 2.5).
      n_groups, topk_groups: group-limited routing (DeepSeek-V3: 8 groups, experts chosen
        from the best 4; a group scores the sum of its top-2 scores); 1/1 disables it.
      selection_bias: keep a buffer ``e_score_correction_bias [E]`` added to the scores for
        expert *selection* only (DeepSeek-V3's auxiliary-loss-free balancing; the training
        loop updates it, forward never does).
    """

    def __init__(self, d_model: int, expert_hidden: int, n_experts: int, top_k: int,
                 n_shared_experts: int = 0, capacity_factor: float | None = 1.25,
                 aux_loss_weight: float = 0.01, score_func: str = "softmax",
                 norm_topk_prob: bool = True, route_scale: float = 1.0,
                 n_groups: int = 1, topk_groups: int = 1, selection_bias: bool = False):
        super().__init__()
        if not 1 <= top_k <= n_experts:
            raise ValueError(f"top_k={top_k} must be in [1, n_experts={n_experts}]")
        if score_func not in ("softmax", "sigmoid"):
            raise ValueError(f"score_func must be 'softmax' or 'sigmoid', got {score_func!r}")
        if n_experts % n_groups or not 1 <= topk_groups <= n_groups:
            raise ValueError(f"n_groups={n_groups} must divide n_experts={n_experts} and "
                             f"1 <= topk_groups={topk_groups} <= n_groups")
        if n_groups > 1 and top_k > topk_groups * (n_experts // n_groups):
            raise ValueError("top_k exceeds the experts in the selected groups")
        if capacity_factor is not None and not capacity_factor > 0:
            raise ValueError(f"capacity_factor must be positive, or None for dropless, got {capacity_factor}")
        self.d_model = d_model
        self.n_experts = n_experts
        self.top_k = top_k
        self.capacity_factor = capacity_factor
        self.aux_loss_weight = aux_loss_weight
        self.score_func = score_func
        self.norm_topk_prob = norm_topk_prob
        self.route_scale = route_scale
        self.n_groups = n_groups
        self.topk_groups = topk_groups
        self.router = nn.Linear(d_model, n_experts, bias=False)
        self.experts = GroupedExperts(d_model, expert_hidden, n_experts)
        self.shared_expert = SwiGLU(d_model, n_shared_experts * expert_hidden) if n_shared_experts else None
        if capacity_factor is None:
            e = self.experts
            moe_dispatch.register_experts(e, GroupedExperts.run_rows, {"w1": e.w1, "w3": e.w3, "w2": e.w2},
                                          type(self).__name__, n_experts, d_model, probe_experts=min(n_experts, 2))
        if selection_bias:
            self.register_buffer("e_score_correction_bias", torch.zeros(n_experts))
        else:
            self.e_score_correction_bias = None

    def reset_parameters(self) -> None:
        """The selection bias starts at zero (the router and experts reset themselves)."""
        if self.e_score_correction_bias is not None:
            nn.init.zeros_(self.e_score_correction_bias)

    # -- routing -------------------------------------------------------------------------
    def route(self, x: torch.Tensor):
        """``x[N, d]`` -> (expert ids ``[N, k]`` int64, gates ``[N, k]`` fp32, probs ``[N, E]`` fp32).

        ``probs`` are the per-token routing probabilities used by the load-balance loss.
        """
        logits = self.router(x).float()
        if self.score_func == "softmax":
            scores = logits.softmax(dim=-1)
            probs = scores
        else:
            scores = logits.sigmoid()
            probs = scores / scores.sum(dim=-1, keepdim=True)
        choice = scores if self.e_score_correction_bias is None else scores + self.e_score_correction_bias
        if self.n_groups > 1:
            n, e = choice.shape
            grouped = choice.view(n, self.n_groups, e // self.n_groups)
            group_score = grouped.topk(min(2, e // self.n_groups), dim=-1).values.sum(dim=-1)
            top_groups = group_score.topk(self.topk_groups, dim=-1).indices  # [N, G']
            group_mask = torch.zeros_like(group_score).scatter(1, top_groups, 1.0)
            expert_mask = group_mask.unsqueeze(-1).expand_as(grouped).reshape(n, e)
            choice = choice.masked_fill(expert_mask == 0, float("-inf"))
        ids = choice.topk(self.top_k, dim=-1).indices
        gates = scores.gather(1, ids)
        if self.norm_topk_prob and self.top_k > 1:
            gates = gates / gates.sum(dim=-1, keepdim=True)
        if self.route_scale != 1.0:
            gates = gates * self.route_scale
        return ids, gates, probs

    def capacity(self, num_tokens: int) -> int:
        return expert_capacity(num_tokens, self.n_experts, self.top_k, self.capacity_factor)

    def dispatch_plan(self, ids: torch.Tensor, capacity: int):
        """Where each ``(token, slot)`` assignment goes, slot-major (index ``s * N + n``).

        Returns (dest ``[k*N]`` int64 in ``[0, E*C]``, the value ``E*C`` meaning dropped;
        keep ``[k*N]`` bool; assignment one-hot ``[k*N, E]`` int64).
        """
        n_experts = self.n_experts
        flat = ids.t().reshape(-1)  # slot-major: every token's first choice ranks before any second choice
        onehot = (flat.unsqueeze(1) == torch.arange(n_experts, device=ids.device)).long()
        rank = onehot.cumsum(dim=0).gather(1, flat.unsqueeze(1)).squeeze(1) - 1  # position inside the expert
        keep = rank < capacity
        dest = torch.where(keep, flat * capacity + rank, torch.full_like(flat, n_experts * capacity))
        return dest, keep, onehot

    # -- the steps of forward (an expert-parallel form overrides ``compute_experts`` only) ----
    def dispatch(self, xf: torch.Tensor, ids: torch.Tensor, gates: torch.Tensor, capacity: int):
        """Fill the expert buffer: ``xf[N, d]`` -> (buf ``[E, C, d]``, slot_token ``[E*C]``,
        slot_gate ``[E*C]``, assignment one-hot ``[k*N, E]``).

        ``slot_token[e*C + c]`` is the token filling slot ``c`` of expert ``e`` (``N`` when the
        slot is empty: it reads an all-zero pad row and its gate is 0); ``slot_gate`` its gate.
        """
        n, d = xf.shape
        n_slots = self.n_experts * capacity
        dest, _keep, onehot = self.dispatch_plan(ids, capacity)
        # Buffer slot -> token filling it (N: the zero pad row); gate of each slot (0 if empty).
        token_ids = torch.arange(n, device=xf.device).repeat(self.top_k)
        slot_token = torch.full((n_slots + 1,), n, dtype=torch.long, device=xf.device)
        slot_token = slot_token.scatter(0, dest, token_ids)[:n_slots]
        slot_gate = torch.zeros(n_slots + 1, dtype=gates.dtype, device=xf.device)
        slot_gate = slot_gate.scatter(0, dest, gates.t().reshape(-1))[:n_slots]
        x_pad = torch.cat([xf, xf.new_zeros(1, d)], dim=0)
        buf = x_pad.index_select(0, slot_token).view(self.n_experts, capacity, d)
        return buf, slot_token, slot_gate, onehot

    def compute_experts(self, buf: torch.Tensor) -> torch.Tensor:
        """``buf[E, C, d]`` -> expert outputs ``[E, C, d]`` (row ``e`` through expert ``e``)."""
        return self.experts(buf)

    def combine(self, xf: torch.Tensor, out: torch.Tensor, slot_token: torch.Tensor,
                slot_gate: torch.Tensor) -> torch.Tensor:
        """Gate-weighted expert outputs ``out[E, C, d]`` index-added back to their tokens, plus
        the shared experts: ``[N, d]``."""
        n, d = xf.shape
        out = out.reshape(-1, d) * slot_gate.to(xf.dtype).unsqueeze(1)
        y = xf.new_zeros(n + 1, d).index_add(0, slot_token, out)[:n]
        if self.shared_expert is not None:
            y = y + self.shared_expert(xf)
        return y

    def balance_loss(self, onehot: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        """Switch load-balance loss over all ``k*N`` assignments (before dropping)."""
        frac = onehot.sum(dim=0).float() / onehot.shape[0]
        return self.aux_loss_weight * self.n_experts * (frac * probs.mean(dim=0)).sum()

    # -- forward -------------------------------------------------------------------------
    @property
    def dropless(self) -> bool:
        return self.capacity_factor is None

    def routed_experts(self, xf: torch.Tensor, ids: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
        """Dropless: ``sum_j gates[n, j] * expert_{ids[n, j]}(xf[n])`` for every token, ``[N, d]``
        (the expert-parallel form holds ``E / ep`` experts and passes its group)."""
        ep = getattr(self, "ep", 1)
        e = self.experts
        return moe_dispatch.dropless_experts(xf, ids, gates, [e.w1, e.w3, e.w2], e,
                                             getattr(self, "ep_group", None), ep, self.n_experts // ep,
                                             getattr(self, "ep_fold_group", None), getattr(self, "ep_fold", 1))

    def forward(self, x: torch.Tensor):
        shape = x.shape
        xf = x.reshape(-1, shape[-1])
        ids, gates, probs = self.route(xf)
        if self.dropless:
            y = self.routed_experts(xf, ids, gates).to(xf.dtype)
            if self.shared_expert is not None:
                y = y + self.shared_expert(xf)
            onehot = (ids.reshape(-1, 1) == torch.arange(self.n_experts, device=ids.device)).long()
            return y.reshape(shape), self.balance_loss(onehot, probs)
        buf, slot_token, slot_gate, onehot = self.dispatch(xf, ids, gates, self.capacity(xf.shape[0]))
        out = self.compute_experts(buf)
        y = self.combine(xf, out, slot_token, slot_gate)
        return y.reshape(shape), self.balance_loss(onehot, probs)
