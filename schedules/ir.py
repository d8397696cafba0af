"""Action IR: what one rank does next, and a whole schedule as data.

An action is ``"{stage}{type}{microbatch}"`` (design.md §4), the same string form as
``torch.distributed.pipelining``: ``"0F1"``, ``"5I0"``, ``"5W0"``, ``"1SEND_F3"``,
``"2RECV_B0"``. Compute types are F (forward), I (backward to the stage input), W (backward
to the stage weights) and B (I and W fused). Communication types only appear after
``lower()``; for SEND_* the stage is the sender, for RECV_* the receiver (torch's convention).

A ``Schedule`` holds the compute actions of every rank in execution order. It never imports
torch: the CLI and the planner load this package without it.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

F, I, W, B = "F", "I", "W", "B"  # noqa: E741 - the action types' own names
SEND_F, RECV_F, SEND_B, RECV_B = "SEND_F", "RECV_F", "SEND_B", "RECV_B"
COMPUTE_TYPES = (F, I, W, B)
COMM_TYPES = (SEND_F, RECV_F, SEND_B, RECV_B)
ALL_TYPES = COMPUTE_TYPES + COMM_TYPES

# Longest alternatives first so "SEND_F" is not read as stage "SEND_" + "F".
_ACTION_RE = re.compile(r"^(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|F|I|W|B)(\d+)$")


@dataclass(frozen=True, order=True)
class Action:
    """One step of one rank: ``type`` applied to ``microbatch`` on ``stage``."""

    stage: int
    type: str
    microbatch: int

    def __post_init__(self):
        if self.type not in ALL_TYPES:
            raise ValueError(f"action type must be one of {', '.join(ALL_TYPES)}, got {self.type!r}")
        if not isinstance(self.stage, int) or self.stage < 0:
            raise ValueError(f"action stage must be an int >= 0, got {self.stage!r}")
        if not isinstance(self.microbatch, int) or self.microbatch < 0:
            raise ValueError(f"action microbatch must be an int >= 0, got {self.microbatch!r}")

    def __str__(self) -> str:
        return f"{self.stage}{self.type}{self.microbatch}"

    @property
    def is_compute(self) -> bool:
        return self.type in COMPUTE_TYPES

    @classmethod
    def parse(cls, text: str) -> "Action":
        """``Action.parse("5W0") == Action(5, "W", 0)``; raises ValueError on anything else."""
        match = _ACTION_RE.match(text.strip())
        if match is None:
            raise ValueError(f"cannot parse action {text!r}: expected '<stage><type><microbatch>' with type in "
                             f"{', '.join(ALL_TYPES)}, e.g. '0F1' or '1SEND_F3'")
        return cls(int(match.group(1)), match.group(2), int(match.group(3)))


@dataclass(frozen=True)
class Schedule:
    """Per-rank compute action lists for ``pp`` ranks, ``num_stages`` stages, ``num_microbatches``.

    ``stage_to_rank[s]`` is the rank holding stage s. ``actions[r]`` is rank r's program in
    execution order. ``overlap[r]`` lists positions i where ``actions[r][i]`` (an F) and
    ``actions[r][i+1]`` (a B or I of another stage) run overlapped as one F&B unit (DualPipeV);
    empty for every other schedule. Full semantic checks live in ``validate()``; construction
    only checks the shape.
    """

    name: str
    pp: int
    num_stages: int
    stage_to_rank: tuple[int, ...]
    num_microbatches: int
    actions: tuple[tuple[Action, ...], ...]
    overlap: tuple[tuple[int, ...], ...] = field(default=())

    def __post_init__(self):
        object.__setattr__(self, "stage_to_rank", tuple(int(r) for r in self.stage_to_rank))
        object.__setattr__(self, "actions", tuple(tuple(a) for a in self.actions))
        overlap = tuple(tuple(sorted(o)) for o in self.overlap) if self.overlap else ()
        if overlap and not any(overlap):
            overlap = ()
        object.__setattr__(self, "overlap", overlap)
        if self.pp < 1 or self.num_stages < 1 or self.num_microbatches < 1:
            raise ValueError(f"schedule {self.name}: pp={self.pp}, stages={self.num_stages}, "
                             f"microbatches={self.num_microbatches} must all be >= 1")
        if len(self.stage_to_rank) != self.num_stages:
            raise ValueError(f"schedule {self.name}: stage_to_rank has {len(self.stage_to_rank)} entries for "
                             f"{self.num_stages} stages")
        if any(not 0 <= r < self.pp for r in self.stage_to_rank):
            raise ValueError(f"schedule {self.name}: stage_to_rank {list(self.stage_to_rank)} names a rank "
                             f"outside 0..{self.pp - 1}")
        if len(self.actions) != self.pp:
            raise ValueError(f"schedule {self.name}: {len(self.actions)} action lists for pp={self.pp} ranks")
        if self.overlap and len(self.overlap) != self.pp:
            raise ValueError(f"schedule {self.name}: {len(self.overlap)} overlap lists for pp={self.pp} ranks")

    # -- queries --------------------------------------------------------------------------

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """The stages rank ``rank`` holds, ascending."""
        return tuple(s for s, r in enumerate(self.stage_to_rank) if r == rank)

    def overlaps(self, rank: int) -> frozenset[int]:
        return frozenset(self.overlap[rank]) if self.overlap else frozenset()

    @property
    def stages_per_rank(self) -> int:
        return max(len(self.stages_of(r)) for r in range(self.pp))

    def __str__(self) -> str:
        lines = [f"{self.name}: pp={self.pp} stages={self.num_stages} microbatches={self.num_microbatches}"]
        for r, acts in enumerate(self.actions):
            lines.append(f"  rank {r}: " + " ".join(map(str, acts)))
        return "\n".join(lines)

    # -- JSON (design.md §4; keep stable, other tools read it) ------------------------------

    def to_dict(self) -> dict:
        data = {
            "schedule": self.name,
            "pp": self.pp,
            "stages": self.num_stages,
            "microbatches": self.num_microbatches,
            "stage_to_rank": list(self.stage_to_rank),
            "actions": [[str(a) for a in acts if a.is_compute] for acts in self.actions],
        }
        if self.overlap:
            data["overlap"] = [list(o) for o in self.overlap]
        return data

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_json(cls, data: str | dict) -> "Schedule":
        """Inverse of ``to_json`` / ``to_dict``; accepts the JSON text or the parsed dict."""
        if isinstance(data, (str, bytes)):
            data = json.loads(data)
        missing = [k for k in ("schedule", "pp", "stages", "microbatches", "stage_to_rank", "actions")
                   if k not in data]
        if missing:
            raise ValueError(f"schedule JSON lacks key(s) {', '.join(missing)}")
        return cls(
            name=data["schedule"],
            pp=int(data["pp"]),
            num_stages=int(data["stages"]),
            stage_to_rank=tuple(data["stage_to_rank"]),
            num_microbatches=int(data["microbatches"]),
            actions=tuple(tuple(Action.parse(a) for a in acts) for acts in data["actions"]),
            overlap=tuple(tuple(o) for o in data.get("overlap", ())),
        )


def forward_only(schedule: Schedule) -> Schedule:
    """Every F of ``schedule``, stage by stage on each rank (all microbatches of a rank's first
    stage, then of its next): the order of an evaluation pass, no backward."""
    acts = [[Action(s, F, k) for s in schedule.stages_of(r) for k in range(schedule.num_microbatches)]
            for r in range(schedule.pp)]
    return make_schedule(f"{schedule.name} forward", schedule.pp, schedule.stage_to_rank, schedule.num_microbatches,
                         acts)


def make_schedule(name: str, pp: int, stage_to_rank, num_microbatches: int, actions, overlap=()) -> Schedule:
    """Build a Schedule from per-rank lists (generators call this)."""
    return Schedule(name=name, pp=pp, num_stages=len(stage_to_rank), stage_to_rank=tuple(stage_to_rank),
                    num_microbatches=num_microbatches, actions=tuple(tuple(a) for a in actions),
                    overlap=tuple(tuple(o) for o in overlap))


def linear_layout(pp: int, v: int) -> tuple[int, ...]:
    """Megatron interleaving: stage s on rank s % pp (v stages per rank)."""
    return tuple(s % pp for s in range(pp * v))


def v_layout(pp: int) -> tuple[int, ...]:
    """V shape: rank r holds stages r and 2*pp-1-r."""
    return tuple(s if s < pp else 2 * pp - 1 - s for s in range(2 * pp))
