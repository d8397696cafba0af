"""Whole state by FQN out of a built ParallelModel, and back in: each parallelism owner maps
its shards (autopar/parallel/base.py: ``whole`` / ``load_whole`` / ``sharded``)."""
from __future__ import annotations

from collections import namedtuple

import torch

IncompatibleKeys = namedtuple("IncompatibleKeys", ["missing_keys", "unexpected_keys"])


def whole_state(built, model) -> dict:
    """Every name of ``model.state_dict()`` with its whole value, on every rank (collective):
    each owner's whole values first (ZeRO-3 gathers, expert shards, fp32 masters), then each
    tensor from the pipeline rank that holds it (buffers from this process's replica)."""
    whole = {}
    for owner in built.parallelisms.values():
        whole.update(owner.whole())
    canonical = built.parallelisms["pp"].canonical
    local = {k: whole.get(canonical.get(k, k), v) for k, v in model.state_dict(keep_vars=True).items()}
    for owner in built.parallelisms.values():
        local = owner.widen(local)
    return built.parallelisms["pp"].gather_state(local)


def load_whole_state(built, model, state_dict: dict, strict: bool = True) -> IncompatibleKeys:
    """Write whole values by FQN: every rank the tensors it holds whole, each owner its shards."""
    current = model.state_dict(keep_vars=True)
    missing = [k for k in current if k not in state_dict]
    unexpected = [k for k in state_dict if k not in current]
    if strict and (missing or unexpected):
        raise RuntimeError(f"autopar: load_state_dict: missing keys {missing[:5]}, unexpected keys "
                           f"{unexpected[:5]} (strict=True)")
    canonical = built.parallelisms["pp"].canonical
    sharded = set().union(*(o.sharded for o in built.parallelisms.values()))
    plain = [k for k in current if k in state_dict and canonical.get(k, k) not in sharded
             and not current[k].is_meta]  # a tensor of another rank's stage stays on meta
    wrong = [k for k in plain if tuple(current[k].shape) != tuple(state_dict[k].shape)]
    if wrong:
        k = wrong[0]
        raise RuntimeError(f"autopar: load_state_dict: {k} has shape {tuple(state_dict[k].shape)} in the state "
                           f"dict, the model's is {tuple(current[k].shape)} ({len(wrong)} such keys)")
    with torch.no_grad():
        for k in plain:
            current[k].copy_(state_dict[k])
    values = {canonical.get(k, k): v for k, v in state_dict.items()}
    for owner in built.parallelisms.values():
        values = owner.narrow(values)
    for owner in built.parallelisms.values():
        owner.load_whole(values)
    return IncompatibleKeys(missing, unexpected)
