"""lower(): insert P2P actions; check_deadlock_free(): prove the lowered programs finish.

Runtime semantics modelled here (what the per-rank executor does):

* ``SEND_F``/``SEND_B`` are non-blocking and buffered: issuing one never waits;
* a ``RECV_*`` blocks its rank until the matching send has been issued on the peer;
* a compute action reads a value from another rank only through a RECV that came earlier in
  its own program; values from a stage on the same rank need no communication.

Placement. A send goes right after the compute action that produced the value. A receive is
posted as early as the timed replay (``simulate`` with ``costs``, unit costs by default)
allows: just before the first action of the receiving rank that starts at or after the time
the send is issued. That replay is itself an execution of the lowered programs in which no
receive ever waits past its send, so the placement adds no delay in the model and cannot
deadlock; ``check_deadlock_free`` re-checks it without timing.

Naming follows torch.distributed.pipelining: SEND_F(s,k) / SEND_B(s,k) carry the sender's
stage, RECV_F(s+1,k) / RECV_B(s-1,k) the receiver's.
"""
from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass

from autopar.schedules.deps import Key, needs, producers, produces
from autopar.schedules.ir import RECV_B, RECV_F, SEND_B, SEND_F, Action, B, F, I, Schedule
from autopar.schedules.simulate import simulate


@dataclass(frozen=True)
class Lowered:
    """A compute schedule plus its per-rank programs with communication actions.

    ``overlap[r]`` lists positions i in ``actions[r]`` where actions i and i+1 form an F&B unit.
    """

    schedule: Schedule
    actions: tuple[tuple[Action, ...], ...]
    overlap: tuple[tuple[int, ...], ...] = ()

    def __str__(self) -> str:
        lines = [f"{self.schedule.name} (lowered): pp={self.schedule.pp}"]
        for r, acts in enumerate(self.actions):
            lines.append(f"  rank {r}: " + " ".join(map(str, acts)))
        return "\n".join(lines)

    def comm_count(self) -> int:
        return sum(1 for acts in self.actions for a in acts if not a.is_compute)


def _messages(schedule: Schedule, a: Action) -> list[tuple[Action, int, Action]]:
    """(send, receiving rank, recv) for each cross-rank value ``a`` produces."""
    s, k, owner = a.stage, a.microbatch, schedule.stage_to_rank
    out = []
    if a.type == F and s + 1 < schedule.num_stages and owner[s + 1] != owner[s]:
        out.append((Action(s, SEND_F, k), owner[s + 1], Action(s + 1, RECV_F, k)))
    if a.type in (I, B) and s > 0 and owner[s - 1] != owner[s]:
        out.append((Action(s, SEND_B, k), owner[s - 1], Action(s - 1, RECV_B, k)))
    return out


def carried(a: Action) -> Key:
    """The value (a ``deps`` key) that communication action ``a`` moves."""
    s, k = a.stage, a.microbatch
    return {SEND_F: (s, "F", k), SEND_B: (s, "G", k), RECV_F: (s - 1, "F", k), RECV_B: (s + 1, "G", k)}[a.type]


def _later_on_same_rank(a: Action, need: Key) -> str:
    """What ``a`` waits for when its input ``need`` is computed on its own rank but not yet."""
    s, kind, k = need
    if kind == "G":
        return f"the input gradient of stage {s} (mb {k}), computed later on the same rank"
    if s != a.stage:
        return f"F(stage {s}, mb {k}) which comes later on the same rank"
    own = producers(need)[0]
    return f"its {own.type} {own} first"


def lower(schedule: Schedule, costs=None) -> Lowered:
    """Insert SEND_F/RECV_F/SEND_B/RECV_B for every cross-rank edge of ``schedule``."""
    result = simulate(schedule, costs)
    pp = schedule.pp
    start: list[list[float]] = [[] for _ in range(pp)]
    end: list[list[float]] = [[] for _ in range(pp)]
    for r, _a, t0, t1 in result.timeline:  # timeline is grouped by rank, in program order
        start[r].append(t0)
        end[r].append(t1)
    sends_after: list[dict[int, list[Action]]] = [{} for _ in range(pp)]
    recvs_before: list[dict[int, list[tuple[float, Action]]]] = [{} for _ in range(pp)]
    order = 0  # sends in each sender's program order: ties of issue time keep it (below)
    for r, acts in enumerate(schedule.actions):
        ovl = schedule.overlaps(r)
        for i, a in enumerate(acts):
            for send, dst, recv in _messages(schedule, a):
                order += 1
                # The F half of an F&B unit finishes with the unit: send after both halves.
                at = i + 1 if i in ovl else i
                sends_after[r].setdefault(at, []).append(send)
                issued = end[r][i]
                # First action of the receiver that starts at or after the send is issued.
                # (a rank's start times ascend in program order)
                j = bisect_left(start[dst], issued - 1e-12)
                # Never split an F&B unit (both halves start together, so this is only a guard):
                # the receive then goes after the unit, which started before the send.
                if j > 0 and (j - 1) in schedule.overlaps(dst):
                    j += 1
                recvs_before[dst].setdefault(j, []).append((issued, order, recv))
    programs, overlaps = [], []
    for r, acts in enumerate(schedule.actions):
        prog: list[Action] = []
        ovl_out: list[int] = []
        ovl = schedule.overlaps(r)

        def flush_recvs(j: int) -> None:
            # in the order the peer sends: NCCL matches a pair's messages by order, not tag
            # (schedules/nccl.py); an F&B unit's two sends are issued at one time, F first
            for _t, _order, recv in sorted(recvs_before[r].get(j, []), key=lambda x: (x[0], x[1])):
                prog.append(recv)

        for i, a in enumerate(acts):
            flush_recvs(i)
            if i in ovl:
                ovl_out.append(len(prog))
            prog.append(a)
            prog.extend(sends_after[r].get(i, []))
        flush_recvs(len(acts))
        programs.append(tuple(prog))
        overlaps.append(tuple(ovl_out))
    lowered = Lowered(schedule=schedule, actions=tuple(programs),
                      overlap=tuple(overlaps) if any(overlaps) else ())
    return lowered


def check_deadlock_free(lowered: Lowered) -> bool:
    """Replay the lowered programs under the runtime semantics; True, or ValueError naming the stuck ranks."""
    sched = lowered.schedule
    owner, S = sched.stage_to_rank, sched.num_stages
    pp = len(lowered.actions)
    sent: set[Key] = set()  # values whose send was issued
    received: list[set[Key]] = [set() for _ in range(pp)]  # values received on each rank
    done: list[set[Key]] = [set() for _ in range(pp)]  # values computed on each rank
    n_send = sum(1 for acts in lowered.actions for a in acts if a.type in (SEND_F, SEND_B))
    n_recv = sum(1 for acts in lowered.actions for a in acts if a.type in (RECV_F, RECV_B))
    if n_send != n_recv:
        raise ValueError(f"lowered {sched.name}: {n_send} sends but {n_recv} receives")
    ovl = [frozenset(lowered.overlap[r]) if lowered.overlap else frozenset() for r in range(pp)]

    def missing_input(r: int, a: Action) -> str | None:
        """Why compute ``a`` cannot run on rank r now (None if it can). Such a wait is permanent."""
        for need in needs(a, S):
            if owner[need[0]] == owner[a.stage]:
                if need not in done[r]:
                    return _later_on_same_rank(a, need)
            elif need not in received[r]:
                recv = Action(a.stage, RECV_F if need[1] == "F" else RECV_B, a.microbatch)
                return f"a {recv.type} {recv} before it"
        return None

    pos = [0] * pp
    remaining = sum(len(a) for a in lowered.actions)
    while remaining:
        progressed = False
        for r, acts in enumerate(lowered.actions):
            while pos[r] < len(acts):
                a = acts[pos[r]]
                if a.type in (SEND_F, SEND_B):
                    if carried(a) not in done[r]:
                        raise ValueError(f"lowered {sched.name}: rank {r} position {pos[r]}: {a} before the compute "
                                         "that produces its value")
                    sent.add(carried(a))
                elif a.type in (RECV_F, RECV_B):
                    if carried(a) not in sent:
                        break  # blocks until the peer issues the send
                    received[r].add(carried(a))
                else:
                    unit = [a] + ([acts[pos[r] + 1]] if pos[r] in ovl[r] else [])
                    for u in unit:
                        why = missing_input(r, u)
                        if why is not None:
                            raise ValueError(f"lowered {sched.name}: rank {r} position {pos[r]}: {u} needs {why}; "
                                             "it would wait forever")
                    for u in unit:
                        done[r].update(produces(u))
                    pos[r] += len(unit) - 1
                    remaining -= len(unit) - 1
                pos[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = "; ".join(f"rank {r} blocks at position {pos[r]} on {lowered.actions[r][pos[r]]}"
                              for r in range(pp) if pos[r] < len(lowered.actions[r]))
            raise ValueError(f"lowered {sched.name} deadlocks: {stuck}")
    return True
