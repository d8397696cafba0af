"""Expert parallelism for Hugging Face ``transformers`` MoE blocks: dropless, static shapes.

Which blocks (``is_hf_experts`` / ``hf_refusal``): a block whose ``experts`` child is a
transformers experts module, i.e. a class decorated with ``@use_experts_implementation``
(Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3 and most MoE families of transformers 5): its
expert weights are 3-D parameters with the expert on dim 0 (``gate_up_proj [E, 2h, d]``,
``down_proj [E, d, h]``, optional ``*_bias [E, ...]``) and it is called as
``experts(hidden_states [N, d], top_k_index [N, k], top_k_weights [N, k]) -> [N, d]``,
``sum_j top_k_weights[n, j] * expert_{top_k_index[n, j]}(hidden_states[n])``. Everything else
of the block (router, group-limited sigmoid routing and its selection bias, shared experts and
their gate, jitter) is left alone and runs replicated on every rank, so only that one call is
made distributed. The experts' ``experts_implementation`` must be ``grouped_mm`` (the
default) or ``batched_mm``: those are the static-shape implementations (``eager`` loops over
``nonzero()``, which no static graph can hold).

Why tiny Mixtral / Qwen3-MoE capture without EP: transformers 5 picks
``experts_implementation="grouped_mm"`` when none is requested
(``PreTrainedModel.get_correct_experts_implementation``). Its forward sorts the ``N * k``
(token, expert) pairs by expert, counts them with ``histc``, and runs
``grouped_mm(x_sorted, W, offs=cumsum(counts))``; under ``torch.export`` (which sets
``torch.compiler.is_compiling()``) a non-bf16 weight takes the custom op
``transformers::grouped_mm_fallback``, which has a fake kernel and a registered autograd
formula. Every shape is ``[N * k, ...]`` whatever the routing: one static graph. Their
``_is_expert_parallel`` flag makes the same implementations accept a sentinel expert id
``>= num_experts`` (a padding row: sorted to the tail, outside every group, its output
zeroed), which is what this rewrite builds on.

Dispatch, on one rank with its own ``N`` tokens (``E`` experts, ``El = E / ep`` per rank,
``k`` choices per token, ``S = N * k`` assignments):

1. every assignment ``s = n * k + j`` (the experts' own flattening) goes to rank
   ``r = e // El`` of its expert ``e``, into slot ``r * P + (its position among this rank's
   assignments to r, in order s)`` of a send buffer ``[ep * P, d]`` (the token's row) and of
   an id buffer ``[ep * P]`` (``e % El``; empty slots: zero rows and the sentinel id ``El``);
2. two even all-to-alls (rows, differentiable; ids, integer) bring this rank ``[ep * P]``
   slots for its ``El`` experts, chunk ``i`` from rank ``i``;
3. the experts module's own implementation runs on them with ``num_experts = El``, weight 1
   per row and ``_is_expert_parallel`` set (sentinel rows are skipped by ``grouped_mm`` and
   zeroed);
4. the inverse all-to-all returns every slot to the rank that owns its token; each assignment
   reads its slot, is multiplied by its routing weight and the ``k`` of a token are summed
   (``view(N, k, d).sum(1)``, as the implementations do), so the result equals the unsharded
   module's up to the order of fp32 row products inside a matmul.

Dropless, and why the buffers are static: a token picks ``k`` *distinct* experts, at most
``min(k, El)`` of them on one rank, so one rank can send at most ``P = N * min(k, El)``
assignments to another: with ``P`` slots per (source, destination) pair no token is ever
dropped, whatever the routing (all tokens on one rank's experts, or a rank receiving none).
The split sizes are then static (every rank sends ``P`` rows to every rank), no count
exchange is needed, and the captured graph keeps static shapes, which the stage split, the
memory model and the runtime rely on. An uneven all-to-all would move only real rows, but
its output size is data-dependent, which a static graph cannot hold; the receive side would
need the same worst-case buffer anyway.

What it costs: per MoE block and microbatch, the send and receive buffers hold
``ep * P = ep * N * min(k, El)`` rows instead of ``S = N * k``, i.e. ``ep * min(k, El) / k``
times the dropless minimum (2x at ep=2, k=2, E=4; ``ep`` whenever ``El >= k``, e.g.
8x for DeepSeek-V3's E=256, k=8 at ep=8), and so do the expert activations saved for backward
(``[ep * P, 2h]`` and ``[ep * P, h]`` per block) and the bytes on the wire (padding travels,
plus ``ep * P`` int64 expert ids).
``grouped_mm`` computes only the real rows (the padding lies past the last group offset);
``batched_mm`` computes every row, padding included. The router, the shared experts and the
combine are unchanged (``[N, ...]``).

Gradients: the all-to-alls are ``all_to_all_single_autograd``, so the joint trace holds their
backward (design.md §9) and an expert parameter's gradient on a rank already sums the
tokens of every rank of its EP group; the data-parallel owner then sums it over the replicas
holding the same experts, like ``autopar.nn.MoE``'s (see passes/expert_parallel.py).
"""
from __future__ import annotations

import inspect
import logging

import torch
import torch.nn as nn

log = logging.getLogger("autopar")

__all__ = ["STATIC_IMPLEMENTATIONS", "is_hf_experts", "hf_refusal", "hf_expert_count", "apply_hf_expert_parallel",
           "slots_per_pair"]

STATIC_IMPLEMENTATIONS = ("grouped_mm", "batched_mm")
_SIGNATURE = ("self", "hidden_states", "top_k_index", "top_k_weights")
EXPECTED = ("a Hugging Face experts module made by transformers' @use_experts_implementation (3-D expert "
            "parameters with the expert on dim 0, e.g. gate_up_proj [E, 2h, d] and down_proj [E, d, h], called as "
            "experts(hidden_states, top_k_index, top_k_weights)) with experts_implementation "
            f"{' or '.join(map(repr, STATIC_IMPLEMENTATIONS))}")


def _hf_forward(cls: type):
    """The original forward under transformers' dispatching wrapper (``@use_experts_implementation``)
    of the first class in ``cls``'s MRO that has one, or None."""
    for c in cls.__mro__:
        fwd = c.__dict__.get("forward")
        code = getattr(fwd, "__code__", None)
        if code is not None and "experts_interface" in code.co_freevars and hasattr(fwd, "__wrapped__"):
            return fwd.__wrapped__
    return None


def is_hf_experts(module: nn.Module) -> bool:
    """A transformers experts module (``@use_experts_implementation``), recognized or not."""
    return (hasattr(module, "_is_expert_parallel") and hasattr(module, "has_gate")
            and hasattr(module, "config") and _hf_forward(type(module)) is not None)


def hf_expert_count(module: nn.Module) -> int:
    """Global expert count of a transformers experts module (also after the EP rewrite)."""
    return int(getattr(module, "ep_experts", module.num_experts))


def hf_refusal(module: nn.Module) -> str | None:
    """Why EP cannot shard this transformers experts module, or None when it can."""
    sig = tuple(inspect.signature(_hf_forward(type(module))).parameters)
    if sig != _SIGNATURE:
        return f"its forward takes {sig[1:]}, expected {_SIGNATURE[1:]}"
    n_experts = getattr(module, "num_experts", None)
    if not isinstance(n_experts, int) or n_experts < 1:
        return f"it has no integer num_experts (got {n_experts!r})"
    own = [(name, p) for name, p in module.named_parameters(recurse=False)]
    if not own:
        return "it has no expert parameters of its own"
    for name, p in own:
        if p.dim() < 2 or p.shape[0] != n_experts:
            return f"parameter {name} has shape {tuple(p.shape)}, expected the {n_experts} experts on dim 0"
    impl = getattr(module.config, "_experts_implementation", None)
    if impl not in STATIC_IMPLEMENTATIONS:
        return (f"its experts_implementation is {impl!r}, which is not a static-shape implementation; call "
                f"model.set_experts_implementation('grouped_mm') (or pass experts_implementation='grouped_mm' "
                "to from_pretrained / from_config)")
    return None


def slots_per_pair(num_tokens: int, top_k: int, n_local: int) -> int:
    """``P``: the most assignments one rank can send to another (distinct experts per token)."""
    return num_tokens * min(top_k, n_local)


class HFExpertParallel:
    """Mixin over a transformers experts class: this rank holds experts
    ``[ep_rank * El, (ep_rank + 1) * El)``; ``forward`` takes global expert ids and moves the
    rows to the experts' ranks and back (module docstring). Made by ``apply_hf_expert_parallel``."""

    ep: int
    ep_rank: int
    ep_group: str  # group name: a string, so the module deep-copies
    ep_experts: int  # global E; ``num_experts`` is the local El (what the implementations index)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        from torch.distributed._functional_collectives import all_to_all_single, all_to_all_single_autograd

        if hidden_states.dim() != 2 or top_k_index.dim() != 2 or top_k_index.shape != top_k_weights.shape \
                or top_k_index.shape[0] != hidden_states.shape[0]:
            raise ValueError(f"autopar: expert-parallel {type(self).__name__} expects hidden_states [N, d], "
                             f"top_k_index and top_k_weights [N, k]; got {tuple(hidden_states.shape)}, "
                             f"{tuple(top_k_index.shape)}, {tuple(top_k_weights.shape)}")
        n, d = hidden_states.shape
        k = top_k_index.shape[1]
        ep, n_local = self.ep, self.num_experts
        pair = slots_per_pair(n, k, n_local)  # P: static, so no token is ever dropped
        n_slots = ep * pair
        dev = hidden_states.device
        expert = top_k_index.reshape(-1)  # [S], assignment s = token * k + choice
        dest = torch.div(expert, n_local, rounding_mode="floor")  # the rank holding the expert
        onehot = (dest.unsqueeze(1) == torch.arange(ep, device=dev)).long()  # [S, ep]
        rank_in_dest = onehot.cumsum(dim=0).gather(1, dest.unsqueeze(1)).squeeze(1) - 1  # < P by construction
        slot = dest * pair + rank_in_dest  # [S] distinct slots in [0, ep * P)
        assignment = torch.arange(n * k, device=dev)
        # slot -> token filling it (n: the zero pad row), and the local expert id (n_local: sentinel)
        slot_token = torch.full((n_slots,), n, dtype=torch.long, device=dev).scatter(
            0, slot, torch.div(assignment, k, rounding_mode="floor"))
        slot_expert = torch.full((n_slots,), n_local, dtype=torch.long, device=dev).scatter(
            0, slot, expert - dest * n_local)
        x_pad = torch.cat([hidden_states, hidden_states.new_zeros(1, d)], dim=0)
        send = x_pad.index_select(0, slot_token)  # [ep * P, d]; rows [j*P, (j+1)*P) go to rank j
        splits = [pair] * ep
        recv = all_to_all_single_autograd(send, splits, splits, self.ep_group)
        recv_expert = all_to_all_single(slot_expert, splits, splits, self.ep_group)
        ones = top_k_weights.new_ones(n_slots, 1)
        out = super().forward(recv, recv_expert.unsqueeze(1), ones)  # this rank's experts, sentinels zero
        back = all_to_all_single_autograd(out, splits, splits, self.ep_group)  # chunk j: our rows from rank j
        per_assignment = back.index_select(0, slot) * top_k_weights.reshape(-1, 1)
        return per_assignment.view(n, k, d).sum(dim=1).to(hidden_states.dtype)

    def extra_repr(self) -> str:
        lo = self.ep_rank * self.num_experts
        return (f"ep={self.ep}, ep_rank={self.ep_rank}, local experts [{lo}, {lo + self.num_experts}) "
                f"of {self.ep_experts}")


_EP_CLASSES: dict[type, type] = {}


def _ep_class(cls: type) -> type:
    if cls not in _EP_CLASSES:
        name = f"ExpertParallel{cls.__name__}"
        new = type(name, (HFExpertParallel, cls), {"__module__": __name__, "__qualname__": name})
        globals()[name] = new  # picklable by name, like a class written here
        _EP_CLASSES[cls] = new
    return _EP_CLASSES[cls]


def apply_hf_expert_parallel(experts: nn.Module, prefix: str, ep: int, ep_rank: int, group_name: str | None):
    """Keep this rank's ``E / ep`` experts of one recognized transformers experts module, in
    place (``hf_refusal(experts) is None`` and ``E % ep == 0`` checked by the caller); returns
    ``[(fqn, full_shape)]`` of the sharded parameters (``prefix`` ends with ``experts.``).
    ``ep == 1`` changes nothing."""
    n_experts = experts.num_experts
    n_local = n_experts // ep
    lo, hi = ep_rank * n_local, (ep_rank + 1) * n_local
    sharded = []
    for pname, p in list(experts._parameters.items()):
        if p is None:
            continue
        sharded.append((prefix + pname, tuple(p.shape)))
        if ep > 1:
            # a copy of the slice: the model no longer references the full tensor
            experts._parameters[pname] = nn.Parameter(p.detach()[lo:hi].clone(), requires_grad=p.requires_grad)
    if ep > 1:
        experts.__class__ = _ep_class(type(experts))
        experts.ep, experts.ep_rank, experts.ep_group, experts.ep_experts = ep, ep_rank, group_name, n_experts
        experts.num_experts = n_local
        experts._is_expert_parallel = True
    return sharded
