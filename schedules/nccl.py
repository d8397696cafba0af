"""NCCL's point-to-point semantics, replayed on lowered programs (``check_nccl``).

``lower.check_deadlock_free`` replays programs as gloo runs them: a receive matches its send by
tag and a send never waits. NCCL does neither, and a program that passes there can hang, crash
or swap tensors on GPUs. The rules here are NCCL's, taken at their worst (no eager buffering of
small messages):

1. **Channels.** A message travels on a communicator. ``"pair"``: one for each unordered pair of
   ranks, both directions sharing it (NCCL's point-to-point inside one process group).
   ``"direction"``: one for each ordered pair, a sender's sends on one and its receives from the
   same peer on another (what the runtime uses: ``collectives/comms.P2PChannels``).
2. **Order, not tags.** On a channel, the k-th send from rank a to rank b matches the k-th
   receive on b from a, whatever their tags. A pair whose send order and receive order differ
   is an error naming both ranks and both actions (under NCCL the receive would get another
   message: a crash when sizes differ, wrong numbers when they agree).
3. **One stream per channel.** The operations a rank issues to one channel run in the order
   issued: one starts when every earlier one of that rank on that channel has completed.
4. **Rendezvous.** A send and its receive complete together, once both have started: a send
   waits for its receive to be posted (and reached) on the peer.
5. **Batches.** Operations issued together as one batch (``batch_isend_irecv``; an item of a
   program that is a tuple of communication actions) start together.
6. **The host.** A rank issues communication without waiting; a compute action waits for every
   receive it reads (the RECV before it in its program) to complete.

A program that breaks rule 2, or in which some wait can never end, is a ``ValueError`` saying
which ranks, which actions and why. Programs are ``Lowered.actions``-like: per rank, a sequence
of actions, where a tuple of communication actions is one batch.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from autopar.schedules.deps import needs
from autopar.schedules.ir import RECV_B, RECV_F, SEND_B, SEND_F, Action
from autopar.schedules.lower import carried

CHANNELS = ("pair", "direction")


@dataclass(frozen=True)
class _Op:
    rank: int          # the rank that issues it
    peer: int          # the other end
    send: bool
    action: Action
    position: int      # index of its item in the rank's program
    index: int = -1    # its place among the messages from sender to receiver (rule 2)

    def __str__(self) -> str:
        return f"{self.action} (rank {self.rank}, position {self.position})"


def peer_of(action: Action, stage_to_rank) -> int:
    """The rank at the other end of communication action ``action``."""
    s = action.stage
    return stage_to_rank[{SEND_F: s + 1, SEND_B: s - 1, RECV_F: s - 1, RECV_B: s + 1}[action.type]]


def channel(rank: int, peer: int, send: bool, layout: str) -> tuple:
    """The communicator an operation of ``rank`` with ``peer`` is issued to."""
    if layout == "pair":
        return ("pair", min(rank, peer), max(rank, peer))
    src, dst = (rank, peer) if send else (peer, rank)
    return ("direction", src, dst)


def check_nccl(programs, stage_to_rank, num_stages: int, layout: str = "direction", name: str = "") -> bool:
    """Replay ``programs`` (per rank: actions; a tuple of communication actions is one batch)
    under the rules above; True, or ValueError naming the ranks, the actions and why."""
    if layout not in CHANNELS:
        raise ValueError(f"layout must be one of {CHANNELS}, got {layout!r}")
    label = f"{name}: " if name else ""
    pp = len(programs)
    items: list[list[tuple[_Op, ...] | Action]] = []
    sent: dict[tuple[int, int], list[_Op]] = {}
    recvd: dict[tuple[int, int], list[_Op]] = {}
    for r, prog in enumerate(programs):
        row = []
        for pos, item in enumerate(prog):
            acts = item if isinstance(item, tuple) else (item,)
            if len(acts) == 1 and acts[0].is_compute:
                row.append(acts[0])
                continue
            if any(a.is_compute for a in acts):
                raise ValueError(f"{label}rank {r} position {pos}: a batch holds only communication actions, got "
                                 f"{' '.join(map(str, acts))}")
            ops = []
            for a in acts:
                peer, send = peer_of(a, stage_to_rank), a.type in (SEND_F, SEND_B)
                key = (r, peer) if send else (peer, r)
                bucket = (sent if send else recvd).setdefault(key, [])
                op = _Op(r, peer, send, a, pos, len(bucket))
                bucket.append(op)
                ops.append(op)
            row.append(tuple(ops))
        items.append(row)
    _check_order(sent, recvd, label)

    # host state: next item; channel queues of started/pending entries; completed receives
    pc = [0] * pp
    queues: dict[tuple[int, tuple], deque] = {}  # (rank, channel) -> entries (tuples of ops) in issue order
    done: set[_Op] = set()
    received: list[set] = [set() for _ in range(pp)]
    partner = {}
    for key, sends in sent.items():
        for s_op, r_op in zip(sends, recvd[key]):
            partner[s_op], partner[r_op] = r_op, s_op

    def started(op: _Op) -> bool:
        q = queues.get((op.rank, channel(op.rank, op.peer, op.send, layout)))
        return bool(q) and op in q[0]

    while True:
        progressed = False
        for r in range(pp):  # hosts: issue communication, run compute whose receives completed
            while pc[r] < len(items[r]):
                item = items[r][pc[r]]
                if isinstance(item, tuple):
                    by_channel: dict[tuple, list[_Op]] = {}
                    for op in item:
                        by_channel.setdefault(channel(r, op.peer, op.send, layout), []).append(op)
                    for ch, ops in by_channel.items():
                        queues.setdefault((r, ch), deque()).append(tuple(ops))
                else:
                    if any(_reads(item, v, stage_to_rank) and v not in received[r]
                           for v in needs(item, num_stages)):
                        break
                pc[r] += 1
                progressed = True
        for (r, ch), q in list(queues.items()):  # streams: rendezvous at the heads
            while q:
                head = q[0]
                ready = [op for op in head if op not in done and started(partner[op])]
                for op in ready:
                    done.add(op)
                    done.add(partner[op])
                    for o in (op, partner[op]):
                        if not o.send:
                            received[o.rank].add(carried(o.action))
                if all(op in done for op in head):
                    q.popleft()
                    progressed = True
                else:
                    progressed = progressed or bool(ready)
                    break
        if not progressed:
            break
    unfinished = [r for r in range(pp) if pc[r] < len(items[r])]
    pending = [(key, q) for key, q in queues.items() if q]
    if not unfinished and not pending:
        return True
    raise ValueError(f"{label}the programs hang under NCCL's point-to-point rules ({layout} channels): "
                     + "; ".join(_why_stuck(r, items, pc, queues, partner, started, stage_to_rank, num_stages,
                                            received, layout) for r in range(pp)
                                 if pc[r] < len(items[r]) or any(k[0] == r and q for k, q in queues.items())))


def _reads(a: Action, value, stage_to_rank) -> bool:
    """Whether compute ``a`` reads ``value`` from another rank."""
    return stage_to_rank[value[0]] != stage_to_rank[a.stage]


def _check_order(sent, recvd, label: str) -> None:
    for key in sorted(set(sent) | set(recvd)):
        src, dst = key
        sends, recvs = sent.get(key, []), recvd.get(key, [])
        for s_op, r_op in zip(sends, recvs):
            if carried(s_op.action) != carried(r_op.action):
                raise ValueError(
                    f"{label}ranks {src} -> {dst}: message {s_op.index} is {s_op.action} at rank {src} position "
                    f"{s_op.position}, but rank {dst}'s receive {r_op.index} is {r_op.action} at position "
                    f"{r_op.position}; NCCL matches by order, not tag, so that receive would get the other "
                    "message (a crash when the sizes differ, wrong numbers when they agree)")
        if len(sends) != len(recvs):
            raise ValueError(f"{label}ranks {src} -> {dst}: {len(sends)} sends but {len(recvs)} receives")


def _why_stuck(r, items, pc, queues, partner, started, stage_to_rank, num_stages, received, layout) -> str:
    parts = []
    if pc[r] < len(items[r]):
        item = items[r][pc[r]]
        missing = [v for v in needs(item, num_stages) if _reads(item, v, stage_to_rank) and v not in received[r]]
        parts.append(f"rank {r} waits at position {pc[r]} ({item}) for {', '.join(map(_value, missing))}")
    for (rank, ch), q in queues.items():
        if rank != r or not q:
            continue
        for op in q[0]:
            other = partner[op]
            if started(other):
                continue
            behind = queues.get((other.rank, channel(other.rank, other.peer, other.send, layout)))
            blocker = f", queued behind {' + '.join(map(str, behind[0]))}" if behind and other not in behind[0] else ""
            parts.append(f"its {op} waits for {other}{blocker}")
    return ", ".join(parts)


def _value(v) -> str:
    s, kind, k = v
    return f"{'activations' if kind == 'F' else 'gradients'} of stage {s} mb {k}"


def prefetched(programs, stage_to_rank) -> tuple[tuple, ...]:
    """The programs as the CPU runtime issues them (runtime/distributed.py): each receive posted
    at its place or, earlier, as soon as the previous receive from the same peer was consumed
    (just before the compute that reads it; the first at the start of the step). Per peer the
    receives keep their order, so on ``"direction"`` channels this can only post a receive
    sooner, never reorder what a channel carries."""
    num_stages = len(stage_to_rank)
    out = []
    for prog in programs:
        reader: dict = {}  # value -> position of the first compute that reads it
        for j, a in enumerate(prog):
            if not isinstance(a, tuple) and a.is_compute:
                for value in needs(a, num_stages):
                    reader.setdefault(value, j)
        post_at: dict[int, int] = {}
        last: dict[int, int] = {}  # peer -> position of the compute that reads its latest receive
        for i, a in enumerate(prog):
            if isinstance(a, tuple) or a.type not in (RECV_F, RECV_B):
                continue
            peer = peer_of(a, stage_to_rank)
            post_at[i] = min(i, last.get(peer, 0))
            last[peer] = reader.get(carried(a), len(prog))
        new = []
        for j, a in enumerate(prog):
            new.extend(prog[i] for i in sorted(post_at) if post_at[i] == j)
            if j not in post_at:
                new.append(a)
        out.append(tuple(new))
    return tuple(out)
