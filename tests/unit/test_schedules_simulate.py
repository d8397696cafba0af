"""Simulator: hand-computed timings, bubble, memory accounting, trace output."""
import pytest

from autopar.schedules import Action, Costs, build, peak_memory, simulate
from autopar.schedules.ir import make_schedule


def test_gpipe_two_ranks_by_hand():
    # p=2, m=2, per-stage F=1, I=2, W=1 (B=3). Rank 0: F0 [0,1] F1 [1,2]; rank 1: F0 [1,2] F1 [2,3]
    # B0 [3,6] B1 [6,9]; rank 0: B0 [6,9] B1 [9,12].
    r = simulate(build("gpipe", 2, 2), (1, 2, 1))
    assert r.makespan == 12
    assert r.busy == (8, 8)
    assert r.bubble_fraction == pytest.approx(1 - 16 / 24)
    starts = {(rank, str(a)): (s, e) for rank, a, s, e in r.timeline}
    assert starts[(1, "1B1")] == (6, 9)
    assert starts[(0, "0B0")] == (6, 9)


def test_p2p_latency_only_on_cross_rank_edges():
    # V layout p=2: stage 1 -> 2 stays on rank 1 (no latency); 0 -> 1 and 2 -> 3 cross ranks.
    s = make_schedule("v", 2, (0, 1, 1, 0), 1, [
        [Action(0, "F", 0), Action(3, "F", 0), Action(3, "B", 0), Action(0, "B", 0)],
        [Action(1, "F", 0), Action(2, "F", 0), Action(2, "B", 0), Action(1, "B", 0)],
    ])
    c = Costs(f=(1, 1, 1, 1), i=(1, 1, 1, 1), w=(1, 1, 1, 1))
    r = simulate(s, c, p2p_latency=0.5)
    t = {str(a): (st, en) for _, a, st, en in r.timeline}
    assert t["1F0"] == (1.5, 2.5)  # cross-rank: +0.5
    assert t["2F0"] == (2.5, 3.5)  # same rank: no latency
    assert t["3F0"] == (4.0, 5.0)
    assert t["3B0"] == (5.0, 7.0)  # loss stage: right after its own F
    assert t["2B0"] == (7.5, 9.5)
    assert t["1B0"] == (9.5, 11.5)
    assert t["0B0"] == (12.0, 14.0)
    assert r.makespan == 14.0


def test_bandwidth_adds_bytes_over_bandwidth():
    s = build("1f1b", 2, 2)
    base = simulate(s, (1, 1, 1)).makespan
    r = simulate(s, (1, 1, 1), p2p_latency=0.25, p2p_bandwidth=100.0, message_bytes=[50.0])
    # Every microbatch crosses the boundary twice (F then B); the critical path of 1F1B at p=2
    # crosses it 2 times: F0 0->1 and B1 1->0 (0.25 + 0.5 each).
    assert r.makespan == pytest.approx(base + 2 * 0.75)
    with pytest.raises(ValueError, match="needs message_bytes"):
        simulate(s, (1, 1, 1), p2p_bandwidth=10.0)


def test_b_defaults_to_i_plus_w_and_explicit_b():
    s = build("1f1b", 2, 2)
    assert simulate(s, (1, 2, 3)).makespan == simulate(s, (1, 2, 3, 5)).makespan
    assert simulate(s, (1, 2, 3, 1)).makespan < simulate(s, (1, 2, 3)).makespan


def test_per_rank_costs_divide_over_stages():
    # interleaved v=2: per-stage F = 1/2 of the per-rank F.
    s = build("interleaved-1f1b", 2, 2)
    r = simulate(s, (2, 2, 2))
    assert r.busy == (12.0, 12.0)  # m * (F+I+W) per rank
    per_stage = Costs(f=(1, 1, 1, 1), i=(1, 1, 1, 1), w=(1, 1, 1, 1))
    assert simulate(s, per_stage).makespan == r.makespan


def test_costs_errors():
    s = build("1f1b", 2, 2)
    with pytest.raises(ValueError, match="positive"):
        simulate(s, (1, 0, 1))
    with pytest.raises(ValueError, match="given for 3 stages but the schedule has 2"):
        simulate(s, Costs(f=(1, 1, 1), i=(1, 1, 1), w=(1, 1, 1)))
    with pytest.raises(ValueError, match="expected per-rank"):
        simulate(s, (1, 2))


def test_memory_accounting_fraction():
    # One rank, one stage: F F I W I W. F adds 1, I frees half, W the rest.
    s = make_schedule("m", 1, (0,), 2, [[Action(0, "F", 0), Action(0, "F", 1), Action(0, "I", 0),
                                          Action(0, "W", 0), Action(0, "I", 1), Action(0, "W", 1)]])
    assert peak_memory(s) == (2.0,)
    s2 = make_schedule("m", 1, (0,), 2, [[Action(0, "F", 0), Action(0, "I", 0), Action(0, "F", 1),
                                           Action(0, "W", 0), Action(0, "I", 1), Action(0, "W", 1)]])
    assert peak_memory(s2) == (1.5,)  # W0 still holds half of microbatch 0 when F1 runs
    assert peak_memory(s2, i_free_fraction=1.0) == (1.0,)
    assert peak_memory(s2, i_free_fraction=0.0) == (2.0,)
    assert peak_memory(s2, stage_bytes=[1000.0]) == (1500.0,)


def test_known_peaks():
    assert simulate(build("1f1b", 4, 8)).peak_memory == (4, 3, 2, 1)
    assert simulate(build("gpipe", 3, 5)).peak_memory == (5, 5, 5)
    assert simulate(build("zbv", 4, 8)).peak_memory == (4, 4, 4, 4)
    assert simulate(build("dualpipev", 4, 8)).peak_memory == (4.5, 4.5, 4.5, 4.5)
    assert simulate(build("interleaved-1f1b", 4, 8)).peak_memory[0] == 5.5  # p + (p-1)/v
    assert simulate(build("zb-h2", 4, 8)).peak_memory[0] == 7  # 2p - 1
    assert max(simulate(build("v-min", 6, 12)).peak_memory) == 3  # floor((6+4)/3)
    assert max(simulate(build("v-half", 6, 12)).peak_memory) <= 4  # floor((6+2)/2)


def test_fb_overlap_unit_timing():
    d = build("dualpipev", 2, 4)
    slow = simulate(d, Costs.per_rank(1, 1, 1, d.stage_to_rank, fb_ratio=1.0))
    fast = simulate(d, Costs.per_rank(1, 1, 1, d.stage_to_rank, fb_ratio=0.5))
    assert fast.makespan < slow.makespan
    # Both halves of a unit share start and end.
    t = {(r, str(a)): (s, e) for r, a, s, e in slow.timeline}
    i = d.overlap[0][0]
    fa, ba = d.actions[0][i], d.actions[0][i + 1]
    assert t[(0, str(fa))] == t[(0, str(ba))]
    s, e = t[(0, str(fa))]
    assert e - s == pytest.approx(0.5 + 1.0)  # F/2 + (I+W)/2 per stage at unit per-rank costs


def test_simulate_rejects_comm_actions_and_deadlock():
    s = make_schedule("x", 2, (0, 1), 1, [[Action(0, "B", 0), Action(0, "F", 0)],
                                          [Action(1, "F", 0), Action(1, "B", 0)]])
    with pytest.raises(ValueError, match="cannot complete: every rank waits"):
        simulate(s)


@pytest.mark.parametrize("name,pp,m", [("1f1b", 4, 9), ("zb-h1", 3, 7), ("zbv", 2, 6), ("dualpipev", 4, 10),
                                       ("interleaved-1f1b", 2, 8), ("v-half", 3, 6), ("gpipe", 2, 3)])
def test_timeline_satisfies_the_timing_rule(name, pp, m):
    """Every action of the timeline starts exactly when its rank is free and its inputs have
    arrived (the rule of deps.py, plus the boundary's delay across ranks), and lasts its cost
    (an F&B overlap unit: both halves together at fb_ratio of the sum), with uneven costs and
    message sizes: checked action by action, independently of how the simulator gets there."""
    import random

    from autopar.schedules import default_stages_per_rank
    from autopar.schedules.deps import needs, produces

    s = build(name, pp, m, default_stages_per_rank(name))
    rng = random.Random(pp * m)
    S = s.num_stages
    c = Costs(f=tuple(rng.uniform(1, 2) for _ in range(S)), i=tuple(rng.uniform(1, 2) for _ in range(S)),
              w=tuple(rng.uniform(0.5, 1) for _ in range(S)), fb_ratio=0.8)
    msg = [rng.uniform(10, 100) for _ in range(S - 1)]
    r = simulate(s, c, p2p_latency=0.1, p2p_bandwidth=50.0, message_bytes=msg)
    made = {k: end for _, a, _, end in r.timeline for k in produces(a)}
    owner = s.stage_to_rank
    prev_end = [0.0] * pp
    pairs = {(rk, s.actions[rk][i]) for rk in range(pp) for i in s.overlaps(rk)}
    by_rank = {}
    for rank, a, start, end in r.timeline:
        by_rank.setdefault(rank, []).append((a, start, end))
    for rank, rows in by_rank.items():
        j = 0
        while j < len(rows):
            unit = rows[j:j + 2] if (rank, rows[j][0]) in pairs else rows[j:j + 1]
            arrive = max((made[n] + (0.1 + msg[min(n[0], a.stage)] / 50.0 if owner[n[0]] != owner[a.stage] else 0.0)
                          for a, _, _ in unit for n in needs(a, S)), default=0.0)
            start = unit[0][1]
            assert start == pytest.approx(max(prev_end[rank], arrive), abs=1e-12), (rank, unit)
            dur = sum(c.of(a.type, a.stage) for a, _, _ in unit) * (c.fb_ratio if len(unit) == 2 else 1.0)
            assert all(e == pytest.approx(start + dur, abs=1e-12) for _, _, e in unit), (rank, unit)
            prev_end[rank] = unit[0][2]
            j += len(unit)
    assert r.makespan == pytest.approx(max(prev_end))
    # what the planner reads instead of the timeline (simulate(timeline=False)): per rank its end
    # and its last I/W/B's (end, duration), per stage its last W/B's end, counted from the rows here
    lean = simulate(s, c, p2p_latency=0.1, p2p_bandwidth=50.0, message_bytes=msg, timeline=False)
    assert lean.timeline == () and lean.makespan == r.makespan and lean.busy == r.busy
    assert lean.ends == tuple(max(e for _, _, e in by_rank[k]) for k in range(pp))
    assert lean.last_backward == tuple(max(((e, e - b) for a, b, e in by_rank[k] if a.type in "IWB"),
                                           default=(0.0, 0.0)) for k in range(pp))
    assert lean.stage_done == tuple(max((e for _, a, _, e in r.timeline if a.stage == st and a.type in "WB"),
                                        default=0.0) for st in range(S))
