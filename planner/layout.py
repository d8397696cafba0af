"""The plan as data: a candidate's discrete choices (``Layout``), its stage boundaries and
recomputation (``Partition``), what the planner predicts for it (``Estimate``) and the bytes a
parameter element costs (``Precision``). No pricing here: planner/estimate.py's ``Evaluator``
prices a (Layout, Partition)."""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

from autopar.passes.zero_layout import MASTER_BYTES
from autopar.schedules.costs import Costs

from .profile import ModelProfile

GiB = 1024 ** 3


def normal_offload(offload) -> float | tuple[float, ...]:
    """An offload share in its one spelling: a number when every stage has the same (0.0 when
    none is offloaded), else a tuple with one share per stage."""
    if isinstance(offload, (tuple, list)):
        shares = tuple(float(f) for f in offload)
        return shares if len(set(shares)) > 1 else (shares[0] if shares else 0.0)
    return float(offload)


def offload_label(offload) -> str:
    """``0.5`` or ``(1, 0.42, 0)``: how reports and labels print a (normal) offload share."""
    if isinstance(offload, tuple):
        return "(" + ", ".join(f"{f:.3g}" for f in offload) + ")"
    return f"{offload:g}"


@dataclass(frozen=True)
class Layout:
    """The discrete choices of a plan (everything but boundaries and recompute)."""

    pp: int
    dp: int
    cp: int
    ep: int
    schedule: str
    v: int            # stages per rank
    m: int            # microbatches per step (per dp replica)
    b: int            # samples per microbatch
    zero: int
    # share of each stage's saved activations parked on the host between F and I/W: one number
    # for every stage, or a tuple with one per stage (``offload_shares``)
    offload: float | tuple[float, ...] = 0.0
    tp: int = 1       # tensor-parallel degree, the innermost mesh axis (one node)

    def __post_init__(self):
        if type(self.offload) is not float:  # (the search makes many layouts of 0.0)
            object.__setattr__(self, "offload", normal_offload(self.offload))

    @property
    def num_stages(self) -> int:
        return self.pp * self.v

    def offload_of(self, stage: int) -> float:
        """The share of ``stage``'s saved activations parked on the host."""
        return self.offload[stage] if isinstance(self.offload, tuple) else self.offload

    @property
    def sequence_parallel(self) -> bool:
        """tp is priced, and planned, with sequence parallelism (passes/sequence_parallel.py):
        it moves what all-reduces move and cuts what tp ranks would hold alike."""
        return self.tp > 1

    @property
    def world(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    def label(self) -> str:
        return ((f"tp={self.tp} sp " if self.tp > 1 else "")
                + f"pp={self.pp} dp={self.dp} cp={self.cp} ep={self.ep} {self.schedule} v={self.v} "
                f"m={self.m} b={self.b} zero={self.zero}"
                + (f" offload={offload_label(self.offload)}" if self.offload else ""))


@dataclass(frozen=True)
class Partition:
    bounds: tuple[int, ...]        # S+1 unit indices: stage s holds units bounds[s]:bounds[s+1]
    recompute: tuple[bool, ...]    # per stage


@dataclass
class Estimate:
    layout: Layout
    partition: Partition
    stage_to_rank: tuple[int, ...]
    stage_costs: Costs
    makespan_s: float
    dp_exposed_s: float
    optimizer_s: float
    bubble: float
    peak_memory: tuple[float, ...]                    # bytes per pp rank
    memory: tuple[dict, ...]                          # per pp rank: component -> bytes
    memory_limit: float
    tokens_per_s: float = 0.0
    mfu: float = 0.0
    message_bytes: tuple[float, ...] = ()
    p2p_link: tuple[float, float] = (0.0, 1.0)        # (alpha, bandwidth)
    schedule_obj: object = field(default=None, repr=False)
    # activation offload (Layout.offload), per pp rank: the most bytes parked on the host at once,
    # and the copy time compute does not hide, summed over the step's actions
    host_bytes: tuple[float, ...] = ()
    offload_exposed_s: tuple[float, ...] = ()

    @property
    def step_time(self) -> float:
        return self.makespan_s + self.dp_exposed_s + self.optimizer_s

    @property
    def feasible(self) -> bool:
        return max(self.peak_memory) <= self.memory_limit

    def oom(self) -> tuple[int, float]:
        """(worst rank, bytes over the limit)."""
        r = max(range(len(self.peak_memory)), key=self.peak_memory.__getitem__)
        return r, self.peak_memory[r] - self.memory_limit


OPTIMIZERS = ("adamw", "muon")  # what the planner prices (--optimizer)


@dataclass(frozen=True)
class Precision:
    """Bytes per parameter element: weights, gradients (fp32 accumulation), optimizer states (Adam)."""

    name: str
    weight: int
    grad: int
    optim: int   # Adam m + v (+ fp32 master weights in mixed precision)

    @property
    def adam(self) -> int:
        """Adam's two states alone (``optim`` without a master copy)."""
        return self.optim - (MASTER_BYTES if self.weight < 4 else 0)

    @staticmethod
    def for_profile(profile: ModelProfile) -> "Precision":
        pbytes = sum(k.param_bytes for k in profile.kinds)
        params = sum(k.params for k in profile.kinds) or 1
        if pbytes / params < 3:
            return Precision("bf16 weights, fp32 grads, fp32 master + Adam", 2, 4, 12)
        return Precision("fp32 weights, grads, Adam", 4, 4, 8)


@lru_cache(maxsize=None)
def divisors(n: int) -> tuple[int, ...]:
    return tuple(x for x in range(1, n + 1) if n % x == 0)
