"""What every parallelism owner offers the orchestrator (autopar/build.py) and ParallelModel.

An owner is one object per parallelism axis that holds everything the axis changes, in the
order the orchestrator asks for it:

  rewrite_module(model)        before capture: swap modules (EP: MoE experts -> local shards)
  rewrite_capture(captured)    after capture, a pure graph pass (CP: Ulysses all-to-alls)
  rewrite_programs(programs)   after split_backward, a pure pass (ZeRO-3: parameter streaming)
  whole() / load_whole(values) state: whole tensors out of its shards (collective), and its
                               shards from whole tensors (``sharded``: the FQNs whose local
                               tensor is not the whole value, so nobody else writes them)
  widen(values) / narrow(values)  for an axis whose shards the other owners see as the whole
                               parameter (TP): whole values out of the others' (collective),
                               and the blocks the others load out of whole values
  local_shards()               checkpoints: where this process holds pieces of each tensor
                               (``Shard``: flat ranges of the whole value; no communication)

The defaults do nothing; an owner overrides what its axis needs.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Shard:
    """A piece of one tensor that this process holds (checkpoints, autopar/checkpoint.py):
    elements ``[lo, hi)`` of a tensor of shape ``shape``, flattened in row-major order, are
    ``source.view(-1)[start : start + hi - lo]``. ``source`` is the tensor the optimizer steps
    (its per-element optimizer state has the same layout: an fp32 master, a flat ZeRO shard)
    or the live tensor. ``copies`` processes hold the same elements (replicas); this one is
    copy number ``copy`` of them."""

    lo: int
    hi: int
    shape: tuple[int, ...]
    source: object  # torch.Tensor
    start: int = 0
    copies: int = 1
    copy: int = 0


class Parallelism:
    name = ""
    sharded: frozenset[str] = frozenset()

    def rewrite_module(self, model) -> None:
        """Change the eager module in place before capture."""

    def rewrite_capture(self, captured):
        """A new CapturedGraph (the input is not changed)."""
        return captured

    def rewrite_programs(self, programs: dict) -> dict:
        """stage index -> StageProgram, new ones where the axis changes them."""
        return programs

    def whole(self) -> dict:
        """FQN -> whole value of every parameter in ``sharded`` (collective over the axis)."""
        return {}

    def load_whole(self, values: dict) -> None:
        """Write this axis's shards from whole values (every FQN of ``sharded`` is in values)."""

    def widen(self, values: dict) -> dict:
        """Whole values from values the other owners made whole (collective over the axis)."""
        return values

    def narrow(self, values: dict) -> dict:
        """From whole values, what the other owners load for this axis's shards."""
        return values

    def local_shards(self) -> dict[str, list[Shard]]:
        """FQN -> the pieces of it this process holds, as this axis maps them (no communication)."""
        return {}
