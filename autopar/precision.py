"""Mixed precision as data: what the stage programs compute in and what the reduction runs in."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MixedPrecision:
    """``parallelize(..., mixed_precision=MixedPrecision(param_dtype=torch.bfloat16))``.

    ``param_dtype``: the dtype of the compute copies the stage programs read (floating
    parameters only; buffers keep theirs). Every trained parameter keeps an fp32 master that the
    optimizer steps (whole under ZeRO-0, sharded under ZeRO-1/2/3) and that ``state_dict``
    returns; after each step the masters are cast into the compute copies (under ZeRO-3 the
    shards that are gathered). Weight gradients are accumulated over the step's microbatches
    in fp32. ``reduce_dtype``: the dtype of the gradient sums over data-parallel replicas.
    The loss is computed in fp32 where the loss function upcasts (``logits.float()``).
    """

    param_dtype: torch.dtype = torch.bfloat16
    reduce_dtype: torch.dtype = torch.float32

    def __post_init__(self):
        for name in ("param_dtype", "reduce_dtype"):
            dt = getattr(self, name)
            if not isinstance(dt, torch.dtype) or not dt.is_floating_point:
                raise ValueError(f"autopar.MixedPrecision: {name} must be a floating torch.dtype, got {dt!r}")
