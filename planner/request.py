"""The planner's question and answer as data: what a user asks for (``Request``: devices, batch,
sequence, memory limit, what to search or pin; the ``--pin`` grammar, ``parse_pin``, with the
checks that name a pin the runtime cannot express) and what the search returns (``Candidate``,
one priced layout; ``PlanResult``). planner/search.py does the searching."""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from autopar.plan import expert_slots
from autopar.schedules import registry

from .estimate import (
    DEFAULT_MOE_IMBALANCE,
    Estimate,
    Evaluator,
    Layout,
)
from .ilp import DEFAULT_NODES, ILPResult
from .tp_share import TP_DEGREES


@dataclass(frozen=True)
class Request:
    gpus: int
    global_batch: int
    memory_limit: float                 # bytes per device
    schedules: tuple[str, ...] = tuple(registry.names())
    zero_levels: tuple[int, ...] = (0, 1, 2, 3)
    allow_cp: bool = True
    allow_ep: bool = True
    allow_tp: bool = True               # search tensor parallelism (passes/tensor_parallel.py) within a node
    max_cp: int = 64
    max_microbatches: int = 1024
    exhaustive: bool = False            # simulate every layout that passes the screen (--all)
    top_simulate: int = 40
    memory_checks: int = 2000           # layouts found OOM by their memory alone, before stopping
    simulate_actions: int = 1_500_000     # budget of simulated work in the default (not exhaustive) mode:
    # actions simulated, a greedy order's counted GREEDY_WEIGHT times (it is built per (pp, m))
    zb_auto_max: int = 512              # zb-auto only where pp * microbatches <= this (its search is superlinear)
    greedy_max: int = 1024              # zb-h2 / v-half only where pp * microbatches <= this (greedy orders per m)
    top_ilp: int = 4
    ilp_nodes: int = DEFAULT_NODES      # branch-and-bound nodes per stage-boundary ILP (work, not seconds)
    # cp -> None when context parallelism can rewrite the model at that degree, else why not
    # (passes/context_parallel.context_parallel_blocker on the profile's capture); None: judge by
    # the attention head count alone
    cp_blocker: object = field(default=None, compare=False, repr=False)
    # Layout fields fixed by the user (``--pin pp=16,ep=64``): only layouts matching every one
    # are searched; keys are Layout fields (``microbatches``/``num_microbatches`` mean ``m``)
    pin: tuple = ()
    moe_imbalance: float = DEFAULT_MOE_IMBALANCE  # max/mean rows an EP rank receives (dropless MoE)
    loss_chunking: bool = True          # price the chunked cross-entropy where memory binds (--no-loss-chunk)
    offloading: bool = True             # price activation offload where memory binds (--no-offload)
    optimizer: str = "adamw"            # the optimizer priced: "adamw" or "muon" (--optimizer)
    # read and write the schedules' in-flight table on disk ($AUTOPAR_CACHE_DIR/tables); False
    # (--no-cache, and plan_model without profile_cache): nothing read from or written to disk
    disk_cache: bool = field(default=False, compare=False)

    def __post_init__(self):
        if not self.moe_imbalance >= 1.0:
            raise ValueError(f"--moe-imbalance {self.moe_imbalance}: the max/mean ratio of the rows an "
                             f"expert-parallel rank receives must be >= 1 (1.0 = perfectly balanced routing)")
        object.__setattr__(self, "pin", tuple(sorted(_normalize_pin(dict(self.pin)).items())))
        pin = dict(self.pin)
        if all(k in pin for k in ("pp", "dp", "cp", "tp")) and math.prod(pin[k] for k in ("pp", "dp", "cp", "tp")) \
                != self.gpus:
            raise ValueError(f"--pin pp={pin['pp']} dp={pin['dp']} cp={pin['cp']} tp={pin['tp']}: pp*dp*cp*tp = "
                             f"{pin['pp'] * pin['dp'] * pin['cp'] * pin['tp']} is not the GPU count {self.gpus}")
        if all(k in pin for k in ("pp", "dp", "cp")) and "tp" not in pin and \
                self.gpus / (pin["pp"] * pin["dp"] * pin["cp"]) not in (1,) + TP_DEGREES:
            n = pin["pp"] * pin["dp"] * pin["cp"]
            raise ValueError(f"--pin pp={pin['pp']} dp={pin['dp']} cp={pin['cp']}: pp*dp*cp = {n} is not the GPU "
                             f"count {self.gpus} (nor 1/{', 1/'.join(map(str, TP_DEGREES))} of it, with tp the rest)")
        for k in ("pp", "dp", "cp", "tp"):
            if k in pin and self.gpus % pin[k]:
                raise ValueError(f"--pin {k}={pin[k]} does not divide the GPU count {self.gpus}")
        if "ep" in pin and "dp" in pin and ("cp" in pin or all(k in pin for k in ("pp", "tp"))):
            cp = pin["cp"] if "cp" in pin else self.gpus // (pin["pp"] * pin["dp"] * pin["tp"])
            tp = pin.get("tp", self.gpus // (pin["pp"] * pin["dp"] * cp) if "pp" in pin else 1)
            slots = expert_slots(pin["dp"], cp, tp, pin["ep"])
            if slots % pin["ep"]:
                over = f"dp x cp x tp = {pin['dp']} x {cp} x {tp}" if tp > 1 else f"dp x cp = {pin['dp']} x {cp}"
                raise ValueError(f"--pin ep={pin['ep']}: experts are sharded over the {over} = {slots} ranks that hold "
                                 f"a pipeline stage (folded over the tensor-parallel ranks when tp > 1), so ep must "
                                 f"divide {slots}: pin a smaller ep, or more dp or tp")
        if self.gpus < 1:
            raise ValueError(f"autopar plan: --gpus must be >= 1, got {self.gpus}")
        if self.global_batch < 1:
            raise ValueError(f"autopar plan: --global-batch must be >= 1, got {self.global_batch}")
        if self.memory_limit <= 0:
            raise ValueError(f"autopar plan: the memory limit must be positive, got {self.memory_limit}")


_PIN_ALIASES = {"microbatches": "m", "num_microbatches": "m", "stages_per_rank": "v", "microbatch_size": "b"}
_PIN_INT = ("pp", "dp", "cp", "ep", "tp", "v", "m", "b", "zero")


def _normalize_pin(pin: dict) -> dict:
    out = {}
    for k, v in pin.items():
        key = _PIN_ALIASES.get(k, k)
        if key not in _PIN_INT + ("schedule",):
            raise ValueError(f"--pin {k}={v}: unknown field; pin any of {', '.join(_PIN_INT + ('schedule',))} "
                             f"(or microbatches)")
        if key != "schedule":
            try:
                v = int(v)
            except (TypeError, ValueError):
                raise ValueError(f"--pin {k}={v!r}: expected an integer") from None
            if v < (0 if key == "zero" else 1):
                raise ValueError(f"--pin {k}={v}: must be >= {0 if key == 'zero' else 1}")
        elif v not in registry.names():
            raise ValueError(f"--pin schedule={v}: unknown schedule; known: {', '.join(registry.names())}")
        out[key] = v
    return out


def parse_pin(text: str) -> dict:
    """``"pp=16,ep=64,dp=128,zero=1"`` -> {"pp": 16, ...} (validated by :class:`Request`)."""
    out = {}
    for part in (x.strip() for x in text.split(",") if x.strip()):
        if "=" not in part:
            raise ValueError(f"--pin {part!r}: expected field=value, e.g. pp=16,ep=64,dp=128,zero=1")
        k, v = part.split("=", 1)
        out[k.strip()] = v.strip()
    return _normalize_pin(out)


@dataclass
class Candidate:
    layout: Layout
    status: str                         # chosen | feasible | oom | rejected | screened
    reason: str = ""
    screen_time: float = math.inf       # closed-form estimate, seconds
    screen_need: float = 0.0            # bytes per rank it needs at least (a lower bound, _screen)
    screen_tier: int = 0                # 0 expected to fit, 1 expected to fit recomputing, 2 expected not to fit
    estimate: Estimate | None = None
    ilp: ILPResult | None = None
    peaks: tuple[float, ...] | None = None  # per-rank peak bytes when found OOM without timing it
    loss_chunk: int = 0                 # tokens per chunk of the chunked cross-entropy (0: the loss as captured)
    offload: float | tuple[float, ...] = 0.0  # share of the saved activations parked on the host (Layout.offload)
    remake: bool = False                # every stage's backward makes element-wise values again (Plan.remake)
    variants: int = 0                   # the memory-feature variants _simulate priced besides it

    @property
    def priced_layout(self) -> Layout:
        """The layout as priced: ``layout`` with the offload fraction."""
        return replace(self.layout, offload=self.offload) if self.offload else self.layout

    @property
    def time(self) -> float:
        return self.estimate.step_time if self.estimate is not None else math.inf

    @property
    def peak(self) -> float | None:
        """Heaviest rank's predicted bytes (None if never priced beyond the screen)."""
        if self.estimate is not None:
            return max(self.estimate.peak_memory)
        return max(self.peaks) if self.peaks else None


@dataclass
class PlanResult:
    chosen: Candidate | None
    candidates: list[Candidate]
    evaluator: Evaluator
    request: Request
    search_s: float = 0.0
    solver_s: float = 0.0
    ilp_runs: list[ILPResult] = field(default_factory=list)

    def feasible(self) -> list[Candidate]:
        return sorted((c for c in self.candidates if c.status in ("chosen", "feasible")), key=_order)

    def closest(self) -> Candidate | None:
        """The simulated candidate with the smallest peak memory (for infeasible requests)."""
        sims = [c for c in self.candidates if c.peak is not None]
        return min(sims, key=lambda c: (c.peak, _order(c))) if sims else None


def _order(c: Candidate):
    lay = c.layout
    return (round(c.time, 12), lay.pp, lay.cp, lay.ep, lay.tp, lay.zero, lay.schedule, lay.m)
