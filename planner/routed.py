"""A dropless MoE as the planner prices it: the routed rows, their bytes, what each keeps for
W and its FLOPs, read off a unit's ``autopar::moe_dispatch`` ops (``routed_of``; the same path
for a user's dropless model, a Hugging Face experts module captured in its dispatch form, and
the presets' MoE), and the check of a preset's stated MoE numbers against them (``check_moe``)."""
from __future__ import annotations

from dataclasses import dataclass

import torch.fx as fx


@dataclass(frozen=True)
class RoutedInfo:
    """A unit's token-proportional (dropless) MoE dispatch, per captured microbatch, read off
    its ``autopar::moe_dispatch`` ops (``autopar.passes.moe_dispatch.routed_info``: one per MoE
    block) and summed over them: ``rows`` the mean rows one rank dispatches (N tokens x top_k
    per block), ``row_bytes`` one dispatched row, ``saved_row_bytes`` what one received row
    keeps from F until W (the row and the experts' saved activations), ``flops_per_row`` the
    experts' forward FLOPs per row (rows-weighted means over the unit's blocks, so ``rows x``
    each of them is the unit's total), ``dtype`` the compute dtype of the rows, ``overlap_f`` /
    ``overlap_i`` what the all-to-alls can hide behind."""

    rows: float
    row_bytes: float
    saved_row_bytes: float
    flops_per_row: float
    dtype: str = "bfloat16"
    # FLOPs of independent work (a shared expert, its input gradients) the F / I programs run
    # while each of a chain's two all-to-alls is in flight (passes/moe_overlap.py), summed
    overlap_f: tuple[float, float] = (0.0, 0.0)
    overlap_i: tuple[float, float] = (0.0, 0.0)
    # bytes of the blocks' input rows ([N, d] each, summed): what experts folded over tp ranks
    # all-gather after the dispatch in F and (as gradients) in I (passes/moe_dispatch.py)
    token_bytes: float = 0.0

    @property
    def saved_bytes(self) -> float:
        """What the mean rank keeps from F until W (received rows and experts' activations)."""
        return self.rows * self.saved_row_bytes


def routed_of(gm: fx.GraphModule) -> RoutedInfo | None:
    """The routed rows of every dropless MoE dispatch op in ``gm`` (a unit's F program),
    summed (None: no dispatch op: a dense unit, or a static-capacity MoE, priced by its expert
    buffers). The one source for presets and users' models alike: the op's registration
    measured the experts' own code per row (``moe_dispatch.register_experts``)."""
    from autopar.passes.moe_dispatch import routed_info

    rows = row_b = saved_b = flops = tokens_b = 0.0
    hide_f, hide_i = [0.0, 0.0], [0.0, 0.0]
    dtype = None
    for n in gm.graph.nodes:
        info = routed_info(n)
        if info is None:
            continue
        for j in range(2):
            hide_f[j] += info.overlap_f[j]
            hide_i[j] += info.overlap_i[j]
        rows += info.rows
        row_b += info.rows * info.row_bytes
        saved_b += info.rows * info.saved_row_bytes
        flops += info.rows * info.flops_per_row
        x = n.args[0].meta["val"]
        tokens_b += x.numel() * x.element_size()
        dtype = dtype or str(n.args[0].meta["val"].dtype).replace("torch.", "")
    if dtype is None:
        return None
    if not rows:
        return RoutedInfo(0.0, 0.0, 0.0, 0.0, dtype)
    return RoutedInfo(rows=rows, row_bytes=row_b / rows, saved_row_bytes=saved_b / rows, flops_per_row=flops / rows,
                      dtype=dtype, overlap_f=tuple(hide_f), overlap_i=tuple(hide_i), token_bytes=tokens_b)


def check_moe(moe: dict, kinds: list, tokens: int) -> None:
    """``moe`` (a preset's dropless MoE config) against what the capture holds: every unit
    with expert parameters has dispatch ops routing ``tokens x top_k`` rows per MoE block."""
    k = int(moe["top_k"])
    for kind in kinds:
        if not kind.expert_params:
            continue
        if kind.routed is None:
            raise ValueError(f"autopar: profile_model(moe={moe}) expects dropless MoE blocks, but unit {kind.kind} "
                             "holds expert parameters and no autopar::moe_dispatch op: build its MoE with "
                             "autopar.nn.MoE(capacity_factor=None), or pass moe=None for a static-capacity MoE")
        if kind.routed.rows % (tokens * k):
            raise ValueError(f"autopar: unit {kind.kind} routes {kind.routed.rows:g} rows per microbatch, not a "
                             f"multiple of tokens x top_k = {tokens} x {k}: moe={moe} does not describe this model")
