"""Expert parallelism for experts modules that take their rows already grouped by expert.

The form (``is_grouped`` / ``grouped_refusal``): a block with a ``gate`` / ``router`` child hands
its ``experts`` child ONE tensor of rows grouped by expert, expert-major with the same number of
rows ``C`` for every expert: ``[E * C, d]`` or ``[E, C, d]``, and gets back the experts' outputs in
the same layout (``[E * C, d']`` / ``[E, C, d']``), row ``e * C + c`` computed by expert ``e``
alone. Llama 4's ``Llama4TextMoe`` is the public example: it gives every expert all ``N`` tokens
scaled by the expert's router score (``hidden.repeat(E, 1) * scores``, so ``C = N``) and sums
the ``E`` results; static-capacity blocks that fill ``[E, C, d]`` slot buffers are the other.
Every parameter of the experts module (its children's included) holds the ``E`` experts on dim 0
(``parameter_refusal``), its forward takes exactly one positional tensor, and it must compute
with ``E / ep`` experts when its parameters are sliced to them (its ``num_experts``-like
attributes set to ``E / ep``): checked by running the forward on fake tensors with ``[El * 3, d]``
rows, before any communication. That expert ``e``'s rows depend on expert ``e``'s parameters
only is the form's contract (the module views its input as ``[E, -1, d]`` against ``[E, ...]``
weights); nothing cheaper than running it can check it, so it is documented, not probed.

Under EP (``GroupedExpertParallel``) each rank keeps experts ``[r * El, (r + 1) * El)`` and the
call becomes the static all-to-all of ``autopar.nn.MoE``'s capacity form
(passes/expert_parallel.py): rows ``[j * El * C, (j + 1) * El * C)`` (rank j's experts) go to
rank j, which runs the module's own forward on ``[El, ep * C, ...]`` (its experts' rows from every
rank), and the inverse all-to-all brings each rank's rows back in expert order. Both all-to-alls
are even (``C`` is static: every rank of an EP group holds the same microbatch shape), so the
graph stays static and the captured forward holds ``all_to_all_single`` ops whose backward the
joint trace derives (design.md §9); the planner prices the form from the experts' batched
matmuls, as the static form it is (``dispatch_bytes`` in planner/profile.py): no token is
dropped or added, and every expert computes all ``C`` of its rows on every rank.
"""
from __future__ import annotations

import inspect
import math

import torch
import torch.nn as nn

from autopar.collectives import comms

from .hf_moe import (
    LocalExperts,
    _first_forward,
    _hidden_size_candidates,
    expert_count,
    fake_local_call,
    keep_local_experts,
    parameter_refusal,
)

__all__ = ["GroupedExpertParallel", "apply_grouped_expert_parallel", "grouped_refusal", "is_grouped"]

_PROBE_ROWS = 3  # rows per expert the fake probe hands the forward


def is_grouped(module: nn.Module) -> bool:
    """Whether the experts module's forward takes exactly one argument, positional (the grouped
    rows), and nothing else."""
    forward = _first_forward(type(module))
    if forward is None:
        return False
    params = list(inspect.signature(forward).parameters.values())[1:]  # without self
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return len(params) == 1 and params[0].kind in positional


def grouped_refusal(module: nn.Module, block: nn.Module | None = None, ep: int = 1) -> str | None:
    """Why EP cannot shard this grouped-rows experts module at ``ep`` (module docstring), or
    None; ``ep`` must divide its expert count (the caller checks). Pure: fake tensors only."""
    if isinstance(module, GroupedExpertParallel):
        return None
    why = parameter_refusal(module)
    if why:
        return why
    n_local = expert_count(module) // ep
    errors = []
    for d in _hidden_size_candidates(module, block, expert_count(module)):
        why = _probe(module, n_local, d)
        if why is None:
            return None
        errors.append(why)
    return errors[0] if errors else "it has no parameter that gives the hidden size d"


def _probe(module: nn.Module, n_local: int, d: int) -> str | None:
    """Run the forward with the parameters sliced to ``n_local`` experts on fake ``[n_local * 3, d]``
    rows: None when it returns one tensor of ``n_local * 3`` rows."""
    rows = n_local * _PROBE_ROWS
    try:
        out = fake_local_call(module, n_local, lambda dtype, dev: (torch.empty(rows, d, dtype=dtype, device=dev),))
    except Exception as e:  # noqa: BLE001 - the user's code: report what it raised
        return (f"its forward fails on rows grouped by expert [{rows}, {d}] ({_PROBE_ROWS} rows for each of "
                f"{n_local} experts): {type(e).__name__}: {(str(e).splitlines() or [''])[0]}")
    if not isinstance(out, torch.Tensor) or out.dim() < 2 or out.shape[0] != rows:
        shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        return (f"its forward returns {shape} for rows grouped by expert [{rows}, {d}], expected one tensor of "
                f"{rows} rows in the same expert order")
    return None


class GroupedExpertParallel(LocalExperts):
    """Mixin over a grouped-rows experts class: ``forward`` takes the block's ``[E * C, ...]`` or
    ``[E, C, ...]`` rows, sends each expert's rows to its rank, runs the module's own forward on
    the ``[El, ep * C, ...]`` rows of its experts and returns every rank's rows in expert order.
    Made by ``apply_grouped_expert_parallel``."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        x = hidden_states
        E, El, ep = self.ep_experts, self.ep_local, self.ep
        stacked = x.dim() >= 3 and x.shape[0] == E  # [E, C, ...]; else [E * C, ...]
        if not stacked and x.shape[0] % E:
            raise ValueError(f"autopar: expert-parallel {type(self).__name__} got rows {tuple(x.shape)}: expected "
                             f"them grouped by its {E} experts, [E * C, ...] or [E, C, ...]")
        cap = x.shape[1] if stacked else x.shape[0] // E
        rest = tuple(x.shape[2:] if stacked else x.shape[1:])
        width = math.prod(rest)
        splits = [El * cap] * ep  # even: every rank sends C rows for each of rank j's El experts
        recv = comms.all_to_all_autograd(x.reshape(E * cap, width), splits, splits, self.ep_group)
        # [source rank, local expert, row, ...] -> [local expert, source rank * row, ...]
        local = recv.view(ep, El, cap, width).transpose(0, 1)
        local = local.reshape((El, ep * cap) + rest if stacked else (El * ep * cap,) + rest)
        y = _first_forward(type(self))(self, local)
        # the layout the module returned ([El, ep * C, ...] or [El * ep * C, ...]) is kept
        y_stacked = y.dim() >= 3 and y.shape[0] == El and y.shape[1] == ep * cap
        if not y_stacked and y.shape[0] != El * ep * cap:
            raise ValueError(f"autopar: expert-parallel {type(self).__name__} returned {tuple(y.shape)} for rows "
                             f"{tuple(local.shape)} of its {El} experts: expected one output row per row")
        out_rest = tuple(y.shape[2:] if y_stacked else y.shape[1:])
        out_width = math.prod(out_rest)
        # back to [owner rank, local expert, row, ...]: chunk i returns to rank i, its own rows
        send = y.reshape(El, ep, cap, out_width).transpose(0, 1).reshape(E * cap, out_width)
        back = comms.all_to_all_autograd(send, splits, splits, self.ep_group)
        return back.view((E, cap) + out_rest if y_stacked else (E * cap,) + out_rest)



def apply_grouped_expert_parallel(experts: nn.Module, prefix: str, ep: int, ep_rank: int, group_name: str | None,
                                  block: nn.Module | None = None):
    """``hf_moe.keep_local_experts`` for a grouped-rows experts module
    (``grouped_refusal(experts, block, ep) is None`` checked by the caller): its parameters
    sliced to this rank's experts, its forward the two all-to-alls of ``GroupedExpertParallel``."""
    return keep_local_experts(experts, prefix, ep, ep_rank, group_name, GroupedExpertParallel)
