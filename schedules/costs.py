"""Per-stage compute times for the simulator and the cost-aware generator.

Two ways to give costs:

* ``(F, I, W)`` or ``(F, I, W, B)``: per-RANK times (design.md §6: "F/I/W = per-rank times"),
  i.e. one microbatch through a rank's whole share of the model. A rank holding v stages
  spends F/v per stage F. This is what makes a v=2 schedule comparable with a v=1 one.
* ``Costs(f=..., i=..., w=..., b=None)``: explicit per-STAGE tuples (may differ per stage).

B (fused backward) defaults to I + W. ``fb_ratio`` scales an overlapped F&B unit (DualPipeV):
it takes ``fb_ratio * (F + B)``; 1.0 (default) means overlapping buys nothing, which is what
two compute streams sharing one device give without communication to hide.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class Costs:
    f: tuple[float, ...]
    i: tuple[float, ...]
    w: tuple[float, ...]
    b: tuple[float, ...] | None = None
    fb_ratio: float = 1.0

    def __post_init__(self):
        for name in ("f", "i", "w", "b"):
            vals = getattr(self, name)
            if vals is None:
                continue
            vals = tuple(float(x) for x in vals)
            object.__setattr__(self, name, vals)
            if any(not math.isfinite(x) or x <= 0 for x in vals):
                raise ValueError(f"costs: every {name.upper()} time must be a positive finite number, got {list(vals)}")
        n = len(self.f)
        if n == 0 or len(self.i) != n or len(self.w) != n or (self.b is not None and len(self.b) != n):
            raise ValueError(f"costs: F/I/W(/B) must have one entry per stage and equal lengths, got "
                             f"{len(self.f)}/{len(self.i)}/{len(self.w)}"
                             f"{'' if self.b is None else '/' + str(len(self.b))}")
        if not (math.isfinite(self.fb_ratio) and self.fb_ratio > 0):
            raise ValueError(f"costs: fb_ratio must be positive, got {self.fb_ratio}")

    @property
    def num_stages(self) -> int:
        return len(self.f)

    def backward(self, stage: int) -> float:
        return self.b[stage] if self.b is not None else self.i[stage] + self.w[stage]

    def of(self, type_: str, stage: int) -> float:
        if type_ == "F":
            return self.f[stage]
        if type_ == "I":
            return self.i[stage]
        if type_ == "W":
            return self.w[stage]
        if type_ == "B":
            return self.backward(stage)
        raise AssertionError(type_)

    @classmethod
    def per_rank(cls, f: float, i: float, w: float, stage_to_rank: Sequence[int], b: float | None = None,
                 fb_ratio: float = 1.0) -> "Costs":
        """Per-rank times spread evenly over each rank's stages."""
        counts: dict[int, int] = {}
        for r in stage_to_rank:
            counts[r] = counts.get(r, 0) + 1
        share = [1.0 / counts[r] for r in stage_to_rank]
        return cls(f=tuple(f * x for x in share), i=tuple(i * x for x in share), w=tuple(w * x for x in share),
                   b=None if b is None else tuple(b * x for x in share), fb_ratio=fb_ratio)


def as_costs(costs, stage_to_rank: Sequence[int]) -> Costs:
    """Normalise ``None`` (unit per-rank times), a per-rank tuple, or a ``Costs``."""
    if costs is None:
        return Costs.per_rank(1.0, 1.0, 1.0, stage_to_rank)
    if isinstance(costs, Costs):
        if costs.num_stages != len(stage_to_rank):
            raise ValueError(f"costs: given for {costs.num_stages} stages but the schedule has {len(stage_to_rank)}; "
                             "pass per-rank (F, I, W) or one entry per stage")
        return costs
    vals = tuple(costs)
    if len(vals) not in (3, 4):
        raise ValueError(f"costs: expected per-rank (F, I, W) or (F, I, W, B), got {vals!r}")
    try:
        nums = [float(x) for x in vals]
    except (TypeError, ValueError):
        raise ValueError(f"costs: expected numbers (F, I, W[, B]), got {vals!r}") from None
    if any(not math.isfinite(x) or x <= 0 for x in nums):
        raise ValueError(f"costs: F, I, W must be positive, got {vals!r}")
    return Costs.per_rank(nums[0], nums[1], nums[2], stage_to_rank, b=nums[3] if len(nums) == 4 else None)


def activation_units(stage_to_rank: Sequence[int], stage_bytes: Sequence[float] | None = None) -> tuple[float, ...]:
    """Activation memory one F of each stage keeps alive.

    Without ``stage_bytes`` the unit is M_B (one microbatch through a rank's share of the model):
    a rank with v stages gets 1/v per stage F. With ``stage_bytes`` it is those bytes.
    """
    if stage_bytes is not None:
        vals = tuple(float(x) for x in stage_bytes)
        if len(vals) != len(stage_to_rank):
            raise ValueError(f"stage_bytes: {len(vals)} entries for {len(stage_to_rank)} stages")
        if any(not math.isfinite(x) or x < 0 for x in vals):
            raise ValueError(f"stage_bytes must be >= 0, got {list(vals)}")
        return vals
    counts: dict[int, int] = {}
    for r in stage_to_rank:
        counts[r] = counts.get(r, 0) + 1
    return tuple(1.0 / counts[r] for r in stage_to_rank)
