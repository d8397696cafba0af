"""`autopar schedule`: build, check, simulate and show one pipeline schedule.

    autopar schedule NAME --pp P --microbatches M [--stages-per-rank V] [--costs F,I,W]
                     [--memory-limit X] [--p2p-latency L] [--json] [--trace FILE] [--width N]
    autopar schedule --list

Default output: a rank x time grid (wrapped to --width columns), makespan, bubble and peak
activation memory per rank. ``--json`` prints exactly the schedule JSON (design.md §4).
``--trace FILE`` also writes the simulated timeline as Chrome / Perfetto trace-event JSON.
Invalid requests print one line naming the violated constraint to stderr and return 2.
Costs are per-rank times (one microbatch through a rank's share of the model), e.g. in ms.
"""
from __future__ import annotations

import argparse
import sys

from autopar.schedules import render
from autopar.schedules.ir import linear_layout
from autopar.schedules.lower import check_deadlock_free, lower
from autopar.schedules.nccl import check_nccl
from autopar.schedules.registry import GENERATORS, build
from autopar.schedules.simulate import simulate
from autopar.schedules.validate import validate

PROG = "autopar schedule"


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit status 2 via main()
        raise _UsageError(message)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, description="Build, validate and simulate a pipeline schedule.")
    p.add_argument("name", nargs="?", help="schedule name (see --list)")
    p.add_argument("--list", action="store_true", help="list the schedules and their constraints")
    p.add_argument("--pp", type=int, help="pipeline ranks")
    p.add_argument("--microbatches", "-m", type=int, help="microbatches per step")
    p.add_argument("--stages-per-rank", type=int, default=None, help="stages per rank (default: the schedule's)")
    p.add_argument("--costs", default=None, help="per-rank F,I,W[,B] times (default 1,1,1)")
    p.add_argument("--memory-limit", type=float, default=None, help="per-rank activation limit in M_B")
    p.add_argument("--p2p-latency", type=float, default=0.0, help="time to move one tensor between ranks")
    p.add_argument("--effort", type=int, default=0, help="zb-auto: extra randomized restarts (default 0)")
    p.add_argument("--json", action="store_true", help="print the schedule JSON only")
    p.add_argument("--trace", default=None, metavar="FILE", help="write a Chrome/Perfetto trace of the simulation")
    p.add_argument("--width", type=int, default=80, help="terminal width for the grid (default 80)")
    return p


def _parse_costs(text: str | None):
    if text is None:
        return None
    try:
        vals = tuple(float(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"--costs expects numbers F,I,W[,B], got {text!r}") from None
    if len(vals) not in (3, 4):
        raise ValueError(f"--costs expects 3 or 4 numbers F,I,W[,B], got {len(vals)} in {text!r}")
    if any(not x > 0 for x in vals):
        raise ValueError(f"--costs must be positive, got {text!r}")
    return vals


def list_text() -> str:
    rows = [("name", "stages/rank", "constraints", "bubble", "peak memory (M_B)")]
    for g in GENERATORS.values():
        cons = ", ".join(c.text for c in g.constraints if not c.text.startswith("stages_per_rank")) or "m >= 1"
        rows.append((g.name, g.v_text, cons, g.bubble, g.memory))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "schedule":
        argv = argv[1:]
    try:
        args = _parser().parse_args(argv)
        if args.list:
            print(list_text())
            return 0
        if not args.name:
            raise ValueError("missing schedule NAME (see --list)")
        if args.name not in GENERATORS:
            raise ValueError(f"unknown schedule {args.name!r}; known: {', '.join(GENERATORS)}")
        if args.pp is None or args.microbatches is None:
            raise ValueError(f"{args.name} needs --pp and --microbatches")
        if args.effort < 0:
            raise ValueError(f"--effort must be >= 0, got {args.effort}")
        if args.width < 20:
            raise ValueError(f"--width must be >= 20, got {args.width}")
        costs = _parse_costs(args.costs)
        sched = build(args.name, args.pp, args.microbatches, args.stages_per_rank, costs=costs,
                      memory_limit=args.memory_limit, p2p_latency=args.p2p_latency, effort=args.effort)
        validate(sched)
        lowered = lower(sched)
        check_deadlock_free(lowered)
        # NCCL's point-to-point rules on the runtime's channels (one communicator per direction)
        check_nccl(lowered.actions, sched.stage_to_rank, sched.num_stages, "direction", sched.name)
        if args.json:
            print(sched.to_json())
        result = simulate(sched, costs, p2p_latency=args.p2p_latency)
        if args.trace:
            render.write_trace(args.trace, sched, result)
        if not args.json:
            v = sched.stages_per_rank
            if v == 1:
                shape = "one stage per rank"
            elif sched.stage_to_rank == linear_layout(args.pp, v):
                shape = "interleaved"
            else:
                shape = "V"
            print(render.summary(sched, result))
            print(f"stages per rank: {v} ({shape}); costs per rank F,I,W = {args.costs or '1,1,1'}"
                  + (f"; p2p latency {args.p2p_latency:g}" if args.p2p_latency else ""))
            print(render.grid(sched, result, args.width))
            if args.trace:
                print(f"trace written to {args.trace}")
        return 0
    except (_UsageError, ValueError) as exc:
        msg = " ".join(str(exc).split())
        print(f"{PROG}: error: {msg}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `... | head`: the reader left; nothing to report
        return 0
    except OSError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
