"""runtime/send_release.py: a sent tensor is dropped only once its receiver provably has it,
and what a rank holds does not grow with the microbatch count.

The oracle is a vector-clock replay of the lowered programs, written here: every rank runs
its program, a compute action blocks until the messages it needs were sent, every message
carries its sender's clock, and a take merges it. "B took X before A's take of Y" in every
execution exactly when A's clock there has seen B's take of X (happens-before).
"""
import pytest

from autopar import schedules
from autopar.runtime.send_release import release_points
from autopar.schedules.deps import needs
from autopar.schedules.ir import SEND_B, SEND_F, forward_only

CASES = [(name, pp) for name in ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zbv", "v-half", "v-min",
                                 "dualpipev") for pp in (2, 4)]


def _replay(lowered):
    """Vector clocks: (clock of each rank after each of its actions, event index of each take
    per rank: wait key -> position)."""
    owner = lowered.schedule.stage_to_rank
    n, P = lowered.schedule.num_stages, len(lowered.actions)
    clocks = [[0] * P for _ in range(P)]
    pos = [0] * P
    after = [[] for _ in range(P)]
    sent = {}  # wait key at the receiver -> sender's clock at the send
    while any(pos[r] < len(lowered.actions[r]) for r in range(P)):
        moved = False
        for r in range(P):
            while pos[r] < len(lowered.actions[r]):
                a = lowered.actions[r][pos[r]]
                keys = []
                if a.is_compute:
                    for src, kind, k in needs(a, n):
                        if owner[src] != r:
                            keys.append(("F", a.stage, k) if kind == "F" else ("B", a.stage, k))
                    if any(key not in sent for key in keys):
                        break
                clocks[r][r] += 1
                for key in keys:
                    clocks[r] = [max(x, y) for x, y in zip(clocks[r], sent[key])]
                if a.type == SEND_F:
                    sent[("F", a.stage + 1, a.microbatch)] = list(clocks[r])
                elif a.type == SEND_B:
                    sent[("B", a.stage - 1, a.microbatch)] = list(clocks[r])
                after[r].append(list(clocks[r]))
                pos[r] += 1
                moved = True
        assert moved, "the lowered programs deadlock"
    return after


@pytest.mark.parametrize("forward", [False, True], ids=["train", "evaluate"])
@pytest.mark.parametrize("name,pp", CASES)
def test_release_only_after_the_receiver_took_it(name, pp, forward):
    """Training steps, and evaluations (the forward-only program, with its own release points)."""
    m = 4 * pp
    sched = schedules.build(name, pp=pp, num_microbatches=m)
    low = schedules.lower(forward_only(sched) if forward else sched)
    owner = low.schedule.stage_to_rank
    after = _replay(low)
    for rank in range(pp):
        rel = release_points(low.actions, owner, rank)
        acts = low.actions[rank]
        released = set()
        for i, a in enumerate(acts):
            if not a.is_compute:
                continue
            for src, kind, k in needs(a, low.schedule.num_stages):
                if owner[src] == rank:
                    continue
                for skind, s, sk in rel.get(("F", a.stage, k) if kind == "F" else ("B", a.stage, k), ()):
                    peer = owner[s + 1] if skind == "F" else owner[s - 1]
                    take = ("F", s + 1, sk) if skind == "F" else ("B", s - 1, sk)
                    # where the peer took it (its event index, 1-based like the clocks)
                    j = next(j for j, b in enumerate(low.actions[peer]) if b.is_compute and any(
                        owner[src2] != peer and (("F", b.stage, k2) if kind2 == "F" else ("B", b.stage, k2)) == take
                        for src2, kind2, k2 in needs(b, low.schedule.num_stages)))
                    assert after[rank][i][peer] >= j + 1, (
                        f"{name} pp={pp}: rank {rank} drops its send {skind}{s},{sk} at {a} before rank {peer} took it")
                    released.add((skind, s, sk))
        sends = {("F", a.stage, a.microbatch) if a.type == SEND_F else ("B", a.stage, a.microbatch)
                 for a in acts if a.type in (SEND_F, SEND_B)}
        # only the last few sends of the step wait for its end (gpipe: its backward runs after
        # every forward, so nothing comes back after the last rank's gradients)
        if name != "gpipe" and not forward:  # (a forward-only program has few messages back)
            assert len(sends - released) <= 2 * low.schedule.num_stages, (name, pp, rank, sorted(sends - released))


def _most_held(low, rank):
    owner = low.schedule.stage_to_rank
    rel = release_points(low.actions, owner, rank)
    held, most = set(), 0
    for a in low.actions[rank]:
        if a.type in (SEND_F, SEND_B):
            held.add(("F", a.stage, a.microbatch) if a.type == SEND_F else ("B", a.stage, a.microbatch))
            most = max(most, len(held))
        elif a.is_compute:
            for src, kind, k in needs(a, low.schedule.num_stages):
                if owner[src] != rank:
                    held -= set(rel.get(("F", a.stage, k) if kind == "F" else ("B", a.stage, k), ()))
    return most


@pytest.mark.parametrize("name,pp", CASES)
def test_sends_held_do_not_grow_with_microbatches(name, pp):
    """The most sends any rank holds at once, at m = 4p and 16p: equal (gpipe: m, as its
    activations, since every forward runs before the first backward)."""
    held = {}
    for m in (4 * pp, 16 * pp):
        low = schedules.lower(schedules.build(name, pp=pp, num_microbatches=m))
        held[m] = max(_most_held(low, rank) for rank in range(pp))
    if name == "gpipe":
        assert held == {m: m for m in held}
    else:
        assert held[16 * pp] == held[4 * pp] <= 3 * pp, (name, pp, held)
