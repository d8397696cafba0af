"""The schedule registry: one ``Generator`` entry per schedule, and ``build()``.

An entry holds every fact about its schedule: the function that builds it, its stage layout,
its constraints, the bubble and memory texts of ``--list``, its peak-memory bound and the
closed-form bubble the planner screens with.

Each generator states its constraints as data; ``build`` checks them first and raises a
ValueError that names the violated constraint, the numbers and the fix, e.g.
"1f1b needs num_microbatches >= pp: got m=2 < pp=4; use at least 4 microbatches".
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, Sequence

from autopar.schedules.costs import as_costs
from autopar.schedules.gen_1f1b import gpipe, interleaved_1f1b, one_f_one_b, zb_h1
from autopar.schedules.gen_auto import v_half, v_min, zb_auto, zb_h2
from autopar.schedules.gen_v import dualpipev, zbv
from autopar.schedules.ir import Schedule, linear_layout, v_layout
from autopar.schedules.simulate import peak_memory
from autopar.schedules.validate import validate


@dataclass(frozen=True)
class Constraint:
    text: str  # shown by `schedule --list`, e.g. "m >= pp"
    ok: Callable[[int, int, int], bool]  # (pp, m, v) -> holds?
    error: Callable[[str, int, int, int], str]  # (name, pp, m, v) -> message


@dataclass(frozen=True)
class Generator:
    """Everything the package knows about one schedule, in one entry."""

    name: str
    summary: str
    default_v: int
    v_text: str
    constraints: tuple[Constraint, ...]
    bubble: str  # per rank, per-rank times F/I/W (design.md §6)
    memory: str  # peak activations
    backward: str  # what backward actions it emits
    peak_bound: Callable[[int, int, int], float]  # (pp, m, v) -> bound in M_B (zb-auto: its default limit)
    # (pp, m, v) -> the schedule; a searched one also takes build()'s costs, limit and search knobs
    make: Callable[..., Schedule]
    layout: Callable[[int, int], tuple[int, ...]]  # (pp, v) -> stage_to_rank
    # (p, v, F, I, W) -> the planner's closed-form bubble per step, per-rank times: a screen only
    screen_bubble: Callable[[int, int, float, float, float], float]
    searched: bool = False  # the order depends on costs and the memory limit (built per call, not cached)


def _v_is(n: int, why: str) -> Constraint:
    return Constraint(f"stages_per_rank = {n}", lambda p, m, v: v == n,
                      lambda name, p, m, v: f"{name} needs stages_per_rank == {n} ({why}): got {v}; "
                                            f"use stages_per_rank={n}")


def _v_at_least(n: int) -> Constraint:
    return Constraint(f"stages_per_rank >= {n}", lambda p, m, v: v >= n,
                      lambda name, p, m, v: f"{name} needs stages_per_rank >= {n}: got {v}; "
                                            f"use stages_per_rank={n} (or 1f1b for one stage per rank)")


M_GE_P = Constraint("m >= pp", lambda p, m, v: m >= p,
                    lambda name, p, m, v: f"{name} needs num_microbatches >= pp: got m={m} < pp={p}; "
                                          f"use at least {p} microbatches")
M_GE_2P = Constraint("m >= 2*pp", lambda p, m, v: m >= 2 * p,
                     lambda name, p, m, v: f"{name} needs num_microbatches >= 2*pp to fill the V: got m={m} < "
                                           f"2*pp={2 * p}; use at least {2 * p} microbatches")
M_DIV_P = Constraint("m divisible by pp", lambda p, m, v: m % p == 0,
                     lambda name, p, m, v: f"{name} needs num_microbatches divisible by pp (microbatches go round "
                                           f"the ranks in groups of pp): got m={m}, pp={p}; use "
                                           f"{max(p, m - m % p)} or {m - m % p + p}")
ZB_H1_M = Constraint("m >= pp (v = 1), m divisible by pp (v > 1)",
                     lambda p, m, v: m >= p if v == 1 else m % p == 0,
                     lambda name, p, m, v: M_GE_P.error(name, p, m, v) if v == 1 else M_DIV_P.error(name, p, m, v))
V12 = Constraint("stages_per_rank in {1, 2}", lambda p, m, v: v in (1, 2),
                 lambda name, p, m, v: f"{name} needs stages_per_rank 1 (one stage per rank) or 2 (a V): got {v}")

_V_WHY = "a V: rank r holds stages r and 2*pp-1-r"


def _vee(pp: int, v: int) -> tuple[int, ...]:
    """The V layout (the V schedules' constraints make v == 2)."""
    return v_layout(pp)


def _zb_auto_layout(pp: int, v: int) -> tuple[int, ...]:
    """The V with two stages per rank (its search may also return the interleaved layout)."""
    return v_layout(pp) if v == 2 else linear_layout(pp, v)


def _bubble_times(x: float) -> Callable[[int, int, float, float, float], float]:
    """Screening bubble ``x`` times 1F1B's, (p-1)(F+I+W)."""
    return lambda p, v, f, i, w: (p - 1) * (f + i + w) * x


def _zero_bubble_screen(p: int, v: int, f: float, i: float, w: float) -> float:
    """zb-h2 and zb-auto, whose W fill the gaps: screened at a tenth of 1F1B's bubble."""
    return (p - 1) * 0.1 * (f + i + w)


GENERATORS: dict[str, Generator] = {g.name: g for g in (
    Generator("gpipe", "all forwards, then all backwards; the numerics oracle", 1, "1",
              (_v_is(1, "one stage per rank"),), "(p-1)(F+I+W)", "m", "B",
              lambda p, m, v: float(m),
              make=lambda p, m, v: gpipe(p, m), layout=linear_layout, screen_bubble=_bubble_times(1.0)),
    Generator("1f1b", "one forward one backward (PipeDream-flush)", 1, "1",
              (_v_is(1, "one stage per rank; interleaved-1f1b for more"), M_GE_P), "(p-1)(F+I+W)", "p", "B",
              lambda p, m, v: float(p),
              make=lambda p, m, v: one_f_one_b(p, m), layout=linear_layout, screen_bubble=_bubble_times(1.0)),
    Generator("interleaved-1f1b", "Megatron-LM interleaved 1F1B, stage s on rank s % pp", 2, ">= 2",
              (_v_at_least(2), M_DIV_P), "(p-1)(F+I+W)/v", "p + (p-1)/v", "B",
              lambda p, m, v: p + (p - 1) / v,
              make=interleaved_1f1b, layout=linear_layout,
              screen_bubble=lambda p, v, f, i, w: (p - 1) * (f + i + w) / v),
    Generator("zb-h1", "Zero Bubble H1: 1F1B warm-up, W deferred into the cooldown", 1, ">= 1",
              (ZB_H1_M,), "(p-1)(F+I-W)/v", "p", "I+W",
              lambda p, m, v: float(p),
              make=zb_h1, layout=linear_layout, screen_bubble=lambda p, v, f, i, w: (p - 1) * max(0.0, f + i - w)),
    Generator("zb-h2", "Zero Bubble H2: deeper warm-up, W fills every gap", 1, "1",
              (_v_is(1, "one stage per rank"),), "(p-1)F  (0 across steps)", "2p-1", "I+W",
              lambda p, m, v: 2.0 * p - 1,
              make=lambda p, m, v: zb_h2(p, m), layout=linear_layout, screen_bubble=_zero_bubble_screen),
    Generator("zb-auto", "Zero Bubble automatic scheduler (§3.1 heuristic) on real costs, under a memory limit",
              1, "1 or 2 (V)", (V12,), "searched", "<= limit (default p)", "I+W",
              lambda p, m, v: float(p),
              make=zb_auto, layout=_zb_auto_layout, screen_bubble=_zero_bubble_screen, searched=True),
    Generator("zbv", "Zero Bubble V: two stages per rank in a V", 2, "2 (V)",
              (_v_is(2, _V_WHY), M_GE_2P), "(p-1)F/2 at F=I=W", "p", "I+W",
              lambda p, m, v: float(p),
              make=lambda p, m, v: zbv(p, m), layout=_vee, screen_bubble=lambda p, v, f, i, w: (p - 1) * f / 2),
    Generator("v-half", "controllable-memory V, half of 1F1B's activations", 2, "2 (V)",
              (_v_is(2, _V_WHY),), "~1/2 of 1f1b", "floor((p+2)/2)", "I+W",
              lambda p, m, v: float((p + 2) // 2),
              make=lambda p, m, v: v_half(p, m), layout=_vee, screen_bubble=_bubble_times(0.5)),
    Generator("v-min", "controllable-memory V, a third of 1F1B's activations", 2, "2 (V)",
              (_v_is(2, _V_WHY),), "~2/3 of 1f1b", "floor((p+4)/3)", "I+W",
              lambda p, m, v: float((p + 4) // 3),
              make=lambda p, m, v: v_min(p, m), layout=_vee, screen_bubble=_bubble_times(0.67)),
    Generator("dualpipev", "DeepSeek DualPipeV: F of one microbatch overlapped with B of another", 2, "2 (V)",
              (_v_is(2, _V_WHY), M_GE_2P), "(p-1)(F&B+B-3W) stage units", "p + 1/2", "B and I+W",
              lambda p, m, v: p + 0.5,
              make=lambda p, m, v: dualpipev(p, m), layout=_vee, screen_bubble=_bubble_times(0.4)),
)}


def names() -> tuple[str, ...]:
    return tuple(GENERATORS)


def get(name: str) -> Generator:
    gen = GENERATORS.get(name)
    if gen is None:
        raise ValueError(f"unknown schedule {name!r}; known: {', '.join(GENERATORS)}")
    return gen


def default_stages_per_rank(name: str) -> int:
    """2 for the V schedules and interleaved-1f1b, 1 otherwise."""
    return get(name).default_v


def check(name: str, pp: int, num_microbatches: int, stages_per_rank: int | None = None) -> int:
    """Raise ValueError for a violated constraint; return the stages per rank to use."""
    gen = get(name)
    for label, val in (("pp", pp), ("num_microbatches", num_microbatches)):
        if isinstance(val, bool) or not isinstance(val, int) or val < 1:
            raise ValueError(f"{name} needs {label} to be an int >= 1: got {val!r}")
    v = gen.default_v if stages_per_rank is None else stages_per_rank
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{name} needs stages_per_rank to be an int >= 1: got {v!r}")
    for c in gen.constraints:
        if not c.ok(pp, num_microbatches, v):
            raise ValueError(c.error(name, pp, num_microbatches, v))
    return v


@lru_cache(maxsize=512)
def _fixed(name: str, pp: int, m: int, v: int) -> Schedule:
    """A schedule whose order depends only on (pp, m, v): built and validated once."""
    return validate(get(name).make(pp, m, v))


def layout(name: str, pp: int, v: int) -> tuple[int, ...]:
    """stage_to_rank of ``name`` with v stages per rank."""
    return get(name).layout(pp, v)


def screen_bubble(name: str, pp: int, v: int, f: float, i: float, w: float) -> float:
    """The planner's closed-form bubble of ``name`` per step, at per-rank times F, I, W (a screen only)."""
    return get(name).screen_bubble(pp, v, f, i, w)


def build(name: str, pp: int, num_microbatches: int, stages_per_rank: int | None = None, costs=None,
          memory_limit: float | None = None, *, p2p_latency: float = 0.0,
          stage_bytes: Sequence[float] | None = None, i_free_fraction: float = 0.5, effort: int = 0) -> Schedule:
    """The schedule ``name`` for ``pp`` ranks and ``num_microbatches`` microbatches.

    ``costs`` (per-rank (F, I, W[, B]) or a ``Costs``) and ``p2p_latency`` steer zb-auto; the
    fixed schedules ignore them (their order does not depend on costs). ``memory_limit`` is
    per rank, in M_B, or in bytes when ``stage_bytes`` gives each stage's saved activations:
    zb-auto searches under it (default p M_B, 1F1B's budget); a fixed schedule whose peak
    exceeds it is rejected. ``effort`` > 0 adds that many randomized restarts to zb-auto's
    search (slower, sometimes faster schedules); zb-auto with two stages per rank may return a
    V or an interleaved layout (read ``stage_to_rank``).
    """
    v = check(name, pp, num_microbatches, stages_per_rank)
    if costs is not None:
        as_costs(costs, layout(name, pp, v))  # reject malformed costs for every schedule
    gen = get(name)
    if gen.searched:
        return validate(gen.make(pp, num_microbatches, v, costs, memory_limit, p2p_latency, stage_bytes,
                                 i_free_fraction, effort))
    sched = _fixed(name, pp, num_microbatches, v)
    if memory_limit is not None:
        peak = max(peak_memory(sched, stage_bytes, i_free_fraction))
        if peak > memory_limit * (1 + 1e-9):
            unit = "bytes" if stage_bytes is not None else "M_B"
            raise ValueError(f"{name} needs {peak:g} {unit} per rank at peak (pp={pp}, m={num_microbatches}), above "
                             f"the memory limit {memory_limit:g}; use zb-auto with this limit, or v-half / v-min")
    return sched
