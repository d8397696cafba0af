"""The plan: what a run does, as data (frozen, printable, JSON round-trip)."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields


def expert_slots(dp: int, cp: int, tp: int, ep: int) -> int:
    """The ranks of one pipeline stage a plan's experts are sharded over (ep divides it): its
    dp*cp replicas, or, with tp > 1 and ep > 1, those folded over the tp ranks too, dp*cp*tp: the
    tp ranks of a replica then route their own shares of its tokens (runtime/mesh.py)."""
    return dp * cp * (tp if ep > 1 and tp > 1 else 1)

@dataclass(frozen=True)
class Plan:
    """How to parallelize: mesh degrees, pipeline schedule, microbatches, stage boundaries.

    ``stages_per_rank`` None means the schedule's default (2 for V-shaped and interleaved
    schedules, 1 otherwise); ``num_microbatches`` None means the smallest count the schedule
    accepts that is at least 2 * pp. ``stage_cuts`` fixes the pipeline cut positions (indices
    into the captured graph's compute nodes); None lets the stage splitter choose.
    ``recompute`` lists the stages whose F keeps only the stage inputs (I recomputes the rest).
    ``moe_imbalance``: the routed rows one rank of an EP group is expected to receive at most in
    one dropless MoE dispatch, as a multiple of the group's mean (passes/moe_dispatch.py): what
    the planner priced the plan's memory at. A dispatch over it runs on (it moves and allocates
    what the counts say), logs a rate-limited warning (layer, ratio, the bytes beyond the price)
    and counts in ``pm.metrics`` (``moe_over_priced``, ``moe_steps_over_priced``); None: not priced.
    ``moe_receive_limit``: a hard limit on the same ratio, set only by the user: a dispatch over
    it fails on every rank of the group with a ``ReceiveBoundError`` naming the layer and the
    counts; None (the default): none, a dropless dispatch runs at any imbalance.
    ``loss_chunk_tokens``: the last stage's LM head and cross-entropy run this many tokens at a
    time, never holding the ``[tokens, vocab]`` logits (passes/chunked_loss.py); 0 (the
    default): off, the loss runs as captured. A loss of another form always runs as captured.
    ``offload``: the share of what each stage's F keeps for I and W that is parked in host
    memory between them (runtime/offload.py), in [0, 1]: one number for every stage, or a tuple
    with one per stage; 0 (the default): nothing leaves the device.
    ``tp``: tensor-parallel degree, the innermost mesh axis (one node): the linears the captured
    graph proves shardable are split over ``tp`` ranks, the rest replicated
    (passes/tensor_parallel.py); 1 (the default): off.
    ``sequence_parallel``: with tp > 1, what tp ranks would hold alike between the sharded
    linears (residual stream, norms) is cut along the tokens instead, with reduce-scatters and
    all-gathers in place of the all-reduces (passes/sequence_parallel.py); False (the default): off.
    ``compile``: every F, I, W and B program this process runs is compiled by Inductor
    (runtime/compiled.py: C++/OpenMP on CPU, Triton on GPU) and called in place of the op-by-op
    code; a program that cannot be compiled runs op by op, and the log says which and why.
    Training then equals eager within the compiled tolerance of design.md (fp32 reductions may
    be fused and reordered); False (the default): op by op.
    ``remake``: the stages whose backward makes element-wise values and casts (a SwiGLU's
    ``silu(gate) * up``, a norm's fp32 copy) again from what F keeps, instead of F keeping them
    (passes/split_backward.py ``_recompute_cheap``): less activation memory for some
    memory-bound work in I and W, bitwise the same values. True: every stage; False: none; a
    tuple: those stage indices; None (the default): every stage when ``compile`` (the remade
    ops fuse into the kernels that read them), none otherwise. A recomputing stage keeps only
    its inputs either way. The planner turns it on where memory binds.
    """

    pp: int = 1
    dp: int = 1
    cp: int = 1
    ep: int = 1
    schedule: str = "1f1b"
    num_microbatches: int | None = None
    stages_per_rank: int | None = None
    stage_cuts: tuple[int, ...] | None = None
    recompute: tuple[int, ...] = field(default=())
    zero: int = 0  # ZeRO level over the dp*cp replicas: 1 optimizer states, 2 + gradients, 3 + parameters
    moe_imbalance: float | None = None
    moe_receive_limit: float | None = None
    loss_chunk_tokens: int = 0
    offload: float | tuple[float, ...] = 0.0
    tp: int = 1
    sequence_parallel: bool = False
    compile: bool = False
    remake: bool | tuple[int, ...] | None = None

    def __post_init__(self):
        for name in ("pp", "dp", "cp", "ep", "tp"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"autopar.Plan: {name} must be a positive int, got {v!r}")
        if not isinstance(self.compile, bool):
            raise ValueError(f"autopar.Plan: compile={self.compile!r} must be True (Inductor runs every stage "
                             "program) or False (op by op)")
        if not isinstance(self.sequence_parallel, bool) or self.sequence_parallel and self.tp == 1:
            raise ValueError(f"autopar.Plan: sequence_parallel={self.sequence_parallel!r} needs tp > 1 (it cuts "
                             "along the tokens what the tp ranks would otherwise hold alike); set tp, or leave "
                             "sequence_parallel=False")
        m = self.num_microbatches
        if m is not None and (not isinstance(m, int) or m < 1):
            raise ValueError(f"autopar.Plan: num_microbatches must be a positive int or None, got {m!r}")
        if self.stages_per_rank is not None and (not isinstance(self.stages_per_rank, int) or self.stages_per_rank < 1):
            raise ValueError(f"autopar.Plan: stages_per_rank must be a positive int or None, got "
                             f"{self.stages_per_rank!r}")
        if self.zero not in (0, 1, 2, 3):
            raise ValueError(f"autopar.Plan: zero={self.zero!r} must be 0 (none), 1 (optimizer states sharded), "
                             "2 (+ gradients) or 3 (+ parameters)")
        for name in ("moe_imbalance", "moe_receive_limit"):
            v = getattr(self, name)
            if v is not None and not (isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 1):
                raise ValueError(f"autopar.Plan: {name}={v!r} must be a number >= 1 (the largest receive over the "
                                 "mean; 1.0 is perfectly balanced routing) or None")
        c = self.loss_chunk_tokens
        if not isinstance(c, int) or isinstance(c, bool) or c < 0:
            raise ValueError(f"autopar.Plan: loss_chunk_tokens={c!r} must be an int >= 0 (tokens per chunk of the "
                             "chunked cross-entropy; 0 turns it off)")
        off = tuple(self.offload) if isinstance(self.offload, (tuple, list)) else (self.offload,)
        if not off or any(isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 <= f <= 1 for f in off):
            raise ValueError(f"autopar.Plan: offload={self.offload!r} must be a number in [0, 1] (the share of each "
                             "stage's saved activations parked on the host) or a tuple of one per stage")
        object.__setattr__(self, "offload", tuple(float(f) for f in off) if isinstance(self.offload, (tuple, list))
                           else float(self.offload))
        if expert_slots(self.dp, self.cp, self.tp, self.ep) % self.ep:
            over = f"dp*cp*tp = {self.dp}*{self.cp}*{self.tp}" if self.tp > 1 else f"dp*cp = {self.dp}*{self.cp}"
            raise ValueError(f"autopar.Plan: ep={self.ep} must divide {over} = "
                             f"{expert_slots(self.dp, self.cp, self.tp, self.ep)} (experts are sharded over the ranks "
                             "that hold the same pipeline stage, folded over the tp ranks when tp > 1)")
        from autopar.schedules import default_stages_per_rank, names

        if self.schedule not in names():
            raise ValueError(f"autopar.Plan: unknown schedule {self.schedule!r}; choose one of {', '.join(names())}")
        object.__setattr__(self, "recompute", tuple(self.recompute))
        if self.stage_cuts is not None:
            object.__setattr__(self, "stage_cuts", tuple(self.stage_cuts))
        if self.stages_per_rank is None:
            object.__setattr__(self, "stages_per_rank", default_stages_per_rank(self.schedule))
        r = self.remake
        if isinstance(r, (tuple, list)):
            bad = [s for s in r if isinstance(s, bool) or not isinstance(s, int) or not 0 <= s < self.num_stages]
            if bad:
                raise ValueError(f"autopar.Plan: remake={tuple(r)!r} names stages {bad} outside "
                                 f"0..{self.num_stages - 1} "
                                 f"(the plan has {self.num_stages} stages); give stage indices, True, False or None")
            object.__setattr__(self, "remake", tuple(sorted(set(r))))
        elif r is not None and not isinstance(r, bool):
            raise ValueError(f"autopar.Plan: remake={r!r} must be True (every stage), False (none), a tuple of stage "
                             "indices, or None (every stage when compiled, none otherwise)")
        if isinstance(self.offload, tuple) and len(self.offload) != self.num_stages:
            raise ValueError(f"autopar.Plan: offload has {len(self.offload)} fractions but the plan has "
                             f"{self.num_stages} stages (pp {self.pp} x {self.stages_per_rank} per rank); give one "
                             "per stage, or one number for all")

    def remakes(self, stage: int) -> bool:
        """Whether the backward of ``stage`` makes element-wise values again (``remake``)."""
        r = self.remake
        if r is None:
            return self.compile
        return r if isinstance(r, bool) else stage in r

    def offload_of(self, stage: int) -> float:
        """The offload fraction of one stage."""
        return self.offload[stage] if isinstance(self.offload, tuple) else self.offload

    @property
    def num_stages(self) -> int:
        return self.pp * self.stages_per_rank

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | dict) -> "Plan":
        """The inverse of ``to_json``; also takes the JSON of ``autopar plan --json`` (its
        ``recompute_stages`` is ``recompute``; its predictions and report keys are ignored)."""
        data = json.loads(text) if isinstance(text, (str, bytes)) else dict(text)
        if "recompute_stages" in data and "recompute" not in data:
            data["recompute"] = data["recompute_stages"]
        known = {f.name for f in fields(cls)}
        return cls(**{k: (tuple(v) if isinstance(v, list) else v) for k, v in data.items() if k in known})

    def table(self) -> str:
        rows = [("pp", self.pp), ("dp", self.dp), ("cp", self.cp), ("ep", self.ep)] + (
            [("tp", self.tp)] if self.tp > 1 else []) + (
            [("sequence parallel", True)] if self.sequence_parallel else []) + (
            [("compiled (Inductor)", True)] if self.compile else []) + [("schedule", self.schedule),
                ("stages per rank", self.stages_per_rank), ("stages", self.num_stages),
                ("microbatches", self.num_microbatches), ("recompute stages", list(self.recompute) or "none"),
                ("remake stages", [s for s in range(self.num_stages) if self.remakes(s) and s not in self.recompute]
                 or "none"),
                ("ZeRO", self.zero)] + ([("MoE imbalance priced", self.moe_imbalance)]
                                        if self.moe_imbalance is not None else []) + (
            [("MoE receive limit", self.moe_receive_limit)] if self.moe_receive_limit is not None else []) + (
            [("loss chunk (tokens)", self.loss_chunk_tokens)] if self.loss_chunk_tokens else []) + (
            [("offload", self.offload)] if any(map(self.offload_of, range(self.num_stages))) else [])
        w = max(len(k) for k, _ in rows)
        return "\n".join(f"  {k:<{w}}  {v}" for k, v in rows)
