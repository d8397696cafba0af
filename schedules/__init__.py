"""Pipeline schedules as data: generators, simulator, validator, lowering.

    from autopar import schedules
    s = schedules.build("zbv", pp=4, num_microbatches=8)
    schedules.validate(s)
    r = schedules.simulate(s, costs=(1.0, 1.0, 1.0))       # per-rank F, I, W times
    low = schedules.lower(s); schedules.check_deadlock_free(low)
    schedules.check_nccl(low.actions, s.stage_to_rank, s.num_stages)   # NCCL's P2P rules

This package never imports torch (the CLI must start fast).
"""
from autopar.schedules.costs import Costs, activation_units, as_costs
from autopar.schedules.gen_auto import search_zb_auto
from autopar.schedules.ir import (
    ALL_TYPES,
    COMM_TYPES,
    COMPUTE_TYPES,
    Action,
    Schedule,
    forward_only,
)
from autopar.schedules.lower import Lowered, check_deadlock_free, lower
from autopar.schedules.nccl import check_nccl, prefetched
from autopar.schedules.registry import GENERATORS, build, check, default_stages_per_rank, get, names
from autopar.schedules.simulate import SimResult, peak_memory, simulate
from autopar.schedules.validate import validate

__all__ = [
    "Action", "Schedule", "forward_only", "Costs", "SimResult", "Lowered",
    "build", "names", "default_stages_per_rank", "check", "get", "GENERATORS",
    "simulate", "peak_memory", "validate", "lower", "check_deadlock_free", "check_nccl", "prefetched",
    "search_zb_auto", "as_costs", "activation_units",
    "ALL_TYPES", "COMM_TYPES", "COMPUTE_TYPES",
]
