"""validate(schedule): is this a complete, runnable compute schedule? ValueError says why not.

Checks, in order (the first failure is reported, with rank, position and the fix):

1. every action is a compute action (F, I, W, B) of an existing stage and microbatch, on the
   rank that owns its stage;
2. every (stage, microbatch) has exactly one F, and either exactly one B or exactly one I and
   one W (never B together with I/W);
3. per stage, F actions run in increasing microbatch order (the runtime applies buffer
   updates such as BatchNorm running stats in that order, design.md §5);
4. an F&B overlap unit pairs an F with a B or I of another stage, on one rank;
5. within a rank, nothing comes before a same-rank action it needs (the dependency rule of
   ``deps.py``: I/B after its F, W after its I, F(s,k) after F(s-1,k) and I/B(s,k) after
   I/B(s+1,k) when those stages share the rank);
6. across ranks the orders are jointly satisfiable: replaying them under that rule finishes.
"""
from __future__ import annotations

from autopar.schedules.deps import Key, needs, producers, produces
from autopar.schedules.ir import COMPUTE_TYPES, Action, B, F, I, Schedule, W


def validate(schedule: Schedule) -> Schedule:
    """Raise ValueError naming the first problem; return the schedule unchanged if it is sound."""
    name, S, m = schedule.name, schedule.num_stages, schedule.num_microbatches
    owner = schedule.stage_to_rank
    where: dict[tuple[int, str, int], tuple[int, int]] = {}  # (stage, type, mb) -> (rank, position)
    for r, acts in enumerate(schedule.actions):
        for i, a in enumerate(acts):
            if a.type not in COMPUTE_TYPES:
                raise ValueError(f"schedule {name}: rank {r} position {i}: {a} is a communication action; "
                                 "validate() takes the compute schedule (validate before lower())")
            if a.stage >= S or a.microbatch >= m:
                raise ValueError(f"schedule {name}: rank {r} position {i}: {a} is outside stages 0..{S - 1} / "
                                 f"microbatches 0..{m - 1}")
            if owner[a.stage] != r:
                raise ValueError(f"schedule {name}: rank {r} position {i}: {a} runs stage {a.stage}, which lives on "
                                 f"rank {owner[a.stage]} (stage_to_rank); move it to rank {owner[a.stage]}")
            key = (a.stage, a.type, a.microbatch)
            if key in where:
                r0, i0 = where[key]
                raise ValueError(f"schedule {name}: {a} appears twice (rank {r0} position {i0} and rank {r} position "
                                 f"{i}); each pass runs exactly once")
            where[key] = (r, i)
    for s in range(S):
        for k in range(m):
            has = {t for t in COMPUTE_TYPES if (s, t, k) in where}
            tag = f"stage {s} microbatch {k}"
            if F not in has:
                raise ValueError(f"schedule {name}: {tag} has no F ({Action(s, F, k)}); every microbatch runs "
                                 "forward through every stage")
            if B in has and has & {I, W}:
                raise ValueError(f"schedule {name}: {tag} has both B and I/W; use either one fused B or an I and a W")
            if B not in has and has != {F, I, W}:
                if has == {F}:
                    missing = f"{Action(s, B, k)}, or {Action(s, I, k)} and {Action(s, W, k)},"
                else:
                    missing = " and ".join(str(Action(s, t, k)) for t in (I, W) if t not in has)
                raise ValueError(f"schedule {name}: {tag} has no complete backward ({missing} missing); "
                                 "add a B, or an I and a W")
    for r, acts in enumerate(schedule.actions):
        last_f: dict[int, tuple[int, int]] = {}
        for i, a in enumerate(acts):
            if a.type == F:
                prev = last_f.get(a.stage)
                if prev is not None and prev[0] > a.microbatch:
                    raise ValueError(f"schedule {name}: rank {r}: stage {a.stage} runs F of microbatch {a.microbatch} "
                                     f"(position {i}) after microbatch {prev[0]} (position {prev[1]}); forwards of a "
                                     "stage must run in increasing microbatch order")
                last_f[a.stage] = (a.microbatch, i)
    for r in range(schedule.pp):
        acts = schedule.actions[r]
        for i in schedule.overlaps(r):
            if i + 1 >= len(acts):
                raise ValueError(f"schedule {name}: rank {r}: overlap position {i} has no following action")
            fa, ba = acts[i], acts[i + 1]
            if fa.type != F or ba.type not in (B, I) or fa.stage == ba.stage:
                raise ValueError(f"schedule {name}: rank {r}: overlap unit at position {i} is ({fa}, {ba}); an F&B "
                                 "unit is an F followed by a B or I of another stage")
    # 5. same-rank order.
    for r, acts in enumerate(schedule.actions):
        pos = {a: i for i, a in enumerate(acts)}
        for i, a in enumerate(acts):
            for need in needs(a, S):
                if owner[need[0]] != r:
                    continue
                j = min((pos[c] for c in producers(need) if c in pos), default=None)
                if j is not None and j > i:
                    raise ValueError(f"schedule {name}: rank {r}: {a} at position {i} comes before "
                                     f"{acts[j]} at position {j}, which it needs; swap them")
    # 6. cross-rank satisfiability: replay, advancing any rank whose next action's inputs exist.
    done: set[Key] = set()
    pos = [0] * schedule.pp
    remaining = sum(len(a) for a in schedule.actions)
    ovl = [schedule.overlaps(r) for r in range(schedule.pp)]
    while remaining:
        progressed = False
        for r, acts in enumerate(schedule.actions):
            while pos[r] < len(acts):
                unit = [acts[pos[r]]] + ([acts[pos[r] + 1]] if pos[r] in ovl[r] else [])
                if not all(d in done for a in unit for d in needs(a, S)):
                    break
                for a in unit:
                    done.update(produces(a))
                pos[r] += len(unit)
                remaining -= len(unit)
                progressed = True
        if not progressed:
            waits = []
            for r, acts in enumerate(schedule.actions):
                if pos[r] < len(acts):
                    a = acts[pos[r]]
                    what = ", ".join(f"{'/'.join(p.type for p in producers(d))}(stage {d[0]}, mb {d[2]}) on rank "
                                     f"{owner[d[0]]}" for d in needs(a, S) if d not in done)
                    waits.append(f"rank {r} at position {pos[r]} ({a}) waits for {what}")
            raise ValueError(f"schedule {name}: the ranks' orders deadlock: " + "; ".join(waits))
    return schedule
