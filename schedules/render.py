"""Text and trace views of a simulated schedule (used by the CLI).

The grid puts one row per rank and one fixed-width cell per time quantum (the shortest action
of the run). An action of d quanta shows its label then dashes. With two stages per rank the
second (deeper) stage is written in lower case, as in the Zero Bubble paper's figures
("F3" = chunk 0, "f3" = chunk 1); with more, labels carry the stage ("4F3").
Rows wrap in blocks so that no line exceeds ``width`` columns.
"""
from __future__ import annotations

import json

from autopar.schedules.ir import Schedule
from autopar.schedules.simulate import SimResult


def _label(schedule: Schedule, a) -> str:
    v = schedule.stages_per_rank
    if v == 1:
        return f"{a.type}{a.microbatch}"
    if v == 2:
        chunk = schedule.stages_of(schedule.stage_to_rank[a.stage]).index(a.stage)
        return f"{a.type if chunk == 0 else a.type.lower()}{a.microbatch}"
    return str(a)


def grid(schedule: Schedule, result: SimResult, width: int = 80) -> str:
    timeline = result.timeline
    if not timeline:
        return "(empty schedule)"
    quantum = min(end - start for _, _, start, end in timeline)
    labels = {(r, a): _label(schedule, a) for r, a, _, _ in timeline}
    cw = max(len(x) for x in labels.values()) + 1
    ncells = max(1, round(result.makespan / quantum))
    rows = [["." + " " * (cw - 1) for _ in range(ncells)] for _ in range(schedule.pp)]
    in_unit = {(r, schedule.actions[r][i]) for r in range(schedule.pp) for i in schedule.overlaps(r)}
    in_unit |= {(r, schedule.actions[r][i + 1]) for r in range(schedule.pp) for i in schedule.overlaps(r)}

    def paint(r: int, start: float, end: float, text: str) -> None:
        c0 = min(round(start / quantum), ncells - 1)
        n = max(1, round((end - start) / quantum))
        body = text.ljust(n * cw - 1, "-")[:n * cw - 1] + " "
        for j in range(min(n, ncells - c0)):
            rows[r][c0 + j] = body[j * cw:(j + 1) * cw]

    for r, a, start, end in timeline:
        if (r, a) not in in_unit:
            paint(r, start, end, labels[(r, a)])
    # F&B units (DualPipeV): "F3+b0" over the unit's cells.
    when = {(r, a): (start, end) for r, a, start, end in timeline}
    for r, acts in enumerate(schedule.actions):
        for i in schedule.overlaps(r):
            fa, ba = acts[i], acts[i + 1]
            paint(r, *when[(r, fa)], f"{labels[(r, fa)]}+{labels[(r, ba)]}")
    head = max(len(f"r{schedule.pp - 1}"), 2) + 1
    per_block = max(1, (width - head) // cw)
    out = [f"time runs left to right, one cell = {quantum:g} time units; '.' = idle"]
    for b0 in range(0, ncells, per_block):
        if b0:
            out.append("")
        out.append(" " * head + f"t={b0 * quantum:g}")
        for r in range(schedule.pp):
            out.append(f"r{r}".ljust(head) + "".join(rows[r][b0:b0 + per_block]).rstrip())
    return "\n".join(out)


def summary(schedule: Schedule, result: SimResult) -> str:
    unit = "M_B" if result.memory_unit == "M_B" else "bytes"
    peaks = " ".join(f"{x:g}" for x in result.peak_memory)
    return "\n".join([
        f"{schedule.name}: pp={schedule.pp} stages={schedule.num_stages} microbatches={schedule.num_microbatches}",
        f"makespan {result.makespan:g}   bubble {100 * result.bubble_fraction:.1f}%",
        f"peak activation memory per rank ({unit}): {peaks}",
    ])


def trace_events(schedule: Schedule, result: SimResult, time_unit_us: float = 1000.0) -> dict:
    """Chrome / Perfetto trace-event JSON (one thread per rank; times scaled to microseconds)."""
    events: list[dict] = [{"name": "process_name", "ph": "M", "pid": 0, "tid": 0,
                           "args": {"name": f"autopar schedule {schedule.name}"}}]
    for r in range(schedule.pp):
        events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": r, "args": {"name": f"rank {r}"}})
    for r, a, start, end in result.timeline:
        events.append({"name": str(a), "cat": a.type, "ph": "X", "pid": 0, "tid": r,
                       "ts": start * time_unit_us, "dur": (end - start) * time_unit_us,
                       "args": {"stage": a.stage, "microbatch": a.microbatch}})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"schedule": schedule.name, "makespan": result.makespan,
                          "bubble_fraction": result.bubble_fraction}}


def write_trace(path: str, schedule: Schedule, result: SimResult) -> None:
    with open(path, "w") as fh:
        json.dump(trace_events(schedule, result), fh)
