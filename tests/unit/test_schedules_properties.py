"""Property tests over every schedule (acceptance S1, S2).

Example counts are sized so that all schedule tests together stay well under a minute on two
cores: p ranges over [2, 16] and m over every valid count up to 4p, but each generator gets a
handful of examples per run (hypothesis explores different ones on every run).
"""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autopar.schedules import (
    build,
    check_deadlock_free,
    check_nccl,
    lower,
    names,
    peak_memory,
    prefetched,
    search_zb_auto,
    simulate,
    validate,
)
from autopar.schedules.costs import as_costs
from autopar.schedules.gen_auto import makespan_bound
from autopar.schedules.greedy import _ABANDONED, Knobs, _greedy_order, greedy_order
from autopar.schedules.ir import linear_layout, v_layout
from autopar.schedules.registry import GENERATORS

EPS = 1e-9
POSITIVE = st.floats(min_value=0.1, max_value=3.0, allow_nan=False, allow_infinity=False)


@st.composite
def valid_case(draw, name: str):
    """(pp, m, v) satisfying ``name``'s constraints, m anywhere in its valid range up to 4p."""
    p = draw(st.integers(2, 16))
    v = GENERATORS[name].default_v
    if name == "interleaved-1f1b":
        v = draw(st.integers(2, 3))
    if name == "zb-h1":
        v = draw(st.integers(1, 2))  # v = 2 is torch's InterleavedZeroBubble
    if name in ("zbv", "dualpipev"):
        m = draw(st.integers(2 * p, 4 * p))
    elif name == "interleaved-1f1b" or (name == "zb-h1" and v > 1):
        m = p * draw(st.integers(1, 4))
    elif name in ("1f1b", "zb-h1"):
        m = draw(st.integers(p, 4 * p))
    else:
        m = draw(st.integers(1, 4 * p))
    return p, m, v


def _forwards_in_order(s):
    last = {}
    for acts in s.actions:
        for a in acts:
            if a.type == "F":
                assert last.get(a.stage, -1) < a.microbatch, (s.name, a)
                last[a.stage] = a.microbatch


def _check(name, p, m, v, costs, latency, limit=None):
    s = build(name, p, m, stages_per_rank=v, costs=costs, memory_limit=limit, p2p_latency=latency)
    assert (s.pp, s.num_microbatches, s.num_stages) == (p, m, p * v)
    validate(s)
    _forwards_in_order(s)
    low = lower(s, costs)
    assert check_deadlock_free(low)
    # NCCL's rules (schedules/nccl.py) on the runtime's channels, as placed and as the CPU
    # runtime prefetches receives
    assert check_nccl(low.actions, s.stage_to_rank, s.num_stages, "direction", name)
    assert check_nccl(prefetched(low.actions, s.stage_to_rank), s.stage_to_rank, s.num_stages, "direction", name)
    assert low.comm_count() > 0
    peak = max(peak_memory(s))
    bound = limit if limit is not None else GENERATORS[name].peak_bound(p, m, v)
    assert peak <= bound + EPS, (name, p, m, v, peak, bound)
    r = simulate(s, costs, p2p_latency=latency)
    per_rank = m * (costs[0] + costs[1] + costs[2])
    for busy in r.busy:  # every rank does exactly its share of the work
        assert busy == pytest.approx(per_rank)
    # No rank can finish before its own work; the last rank cannot start before F reaches it.
    assert r.makespan >= per_rank + (p - 1) * costs[0] / v - EPS
    assert 0 <= r.bubble_fraction < 1


FIXED = [n for n in names() if n not in ("zb-auto", "v-half")]


@pytest.mark.parametrize("name", FIXED)
@settings(max_examples=10, deadline=None)
@given(data=st.data())
def test_fixed_schedules_valid_deadlock_free_within_bounds(name, data):
    p, m, v = data.draw(valid_case(name))
    costs = data.draw(st.tuples(POSITIVE, POSITIVE, POSITIVE))
    latency = data.draw(st.sampled_from([0.0, 0.05, 0.3]))
    _check(name, p, m, v, costs, latency)


@settings(max_examples=6, deadline=None)
@given(data=st.data())
def test_v_half_valid_within_bound(data):
    p, m, v = data.draw(valid_case("v-half"))
    _check("v-half", p, m, v, data.draw(st.tuples(POSITIVE, POSITIVE, POSITIVE)), 0.0)


@settings(max_examples=10, deadline=None)
@given(data=st.data())
def test_zb_auto_valid_and_within_its_limit(data):
    p, m, _ = data.draw(valid_case("zb-auto"))
    v = data.draw(st.sampled_from([1, 2]))
    costs = data.draw(st.tuples(POSITIVE, POSITIVE, POSITIVE))
    limit = data.draw(st.one_of(st.none(), st.floats(min_value=1.0, max_value=2.0 * p)))
    latency = data.draw(st.sampled_from([0.0, 0.1]))
    _check("zb-auto", p, m, v, costs, latency, limit)
    if limit is None:  # default budget: p M_B
        assert max(peak_memory(build("zb-auto", p, m, v, costs=costs, p2p_latency=latency))) <= p + EPS


# -- closed forms at F = I = W, zero latency (design.md §6) ----------------------------------

@settings(max_examples=25, deadline=None)
@given(name=st.sampled_from(["gpipe", "1f1b", "interleaved-1f1b", "zb-h1"]), p=st.integers(2, 16),
       k=st.integers(1, 4), extra=st.integers(0, 3), v=st.integers(2, 3), c=POSITIVE)
def test_bubble_closed_forms(name, p, k, extra, v, c):
    if name in ("gpipe", "1f1b", "zb-h1"):
        v = 1
        m = p * k + (extra if name != "gpipe" else 0) - (0 if name != "gpipe" else p - 1 - extra % p)
        m = max(m, 1 if name == "gpipe" else p)
    else:
        m = p * k
    if name == "zb-h1" and extra % 2:  # also the interleaved ZB1P form
        v, m = 2, p * k
    s = build(name, p, m, stages_per_rank=v)
    r = simulate(s, (c, c, c))
    work = 3 * m * c
    bubble = {"gpipe": (p - 1) * 3 * c, "1f1b": (p - 1) * 3 * c,
              "interleaved-1f1b": (p - 1) * 3 * c / v, "zb-h1": (p - 1) * c / v}[name]
    assert r.makespan == pytest.approx(work + bubble, rel=1e-9)
    assert r.bubble_fraction == pytest.approx(bubble / (work + bubble), rel=1e-6, abs=1e-12)


# -- zb-auto in planner mode: greedy runs abandoned past the best so far, the search stopped at
# the first order that reaches the makespan bound; the whole search (every candidate simulated)
# and the hand-derived bound are the references

@settings(max_examples=12, deadline=None)
@given(p=st.integers(2, 8), v=st.integers(1, 2), data=st.data(),
       costs=st.tuples(POSITIVE, POSITIVE, POSITIVE), latency=st.sampled_from([0.0, 0.0, 0.2]),
       slack=st.sampled_from([1.0, 1.5, 3.0]))
def test_zb_auto_planner_mode_keeps_the_whole_search_result(p, v, data, costs, latency, slack):
    m = data.draw(st.integers(1 if v == 1 else 2, 3 * p))
    limit = slack * p
    whole, cands = search_zb_auto(p, m, v, costs, limit, latency)
    stopped, tried = search_zb_auto(p, m, v, costs, limit, latency, planner=True)
    # as fast as the whole search's best (where orders tie to rounding, possibly another of them)
    assert tried[0].makespan == pytest.approx(cands[0].makespan, rel=1e-9) and tried[0].schedule is stopped
    assert max(peak_memory(stopped)) <= limit + EPS
    assert len(tried) <= len(cands)
    # the bound is a bound: no candidate of the whole search (simulated on its own) goes below it,
    # by hand for one stage per rank: the last rank waits (p-1) F for its first input
    lays = [linear_layout(p, 1)] if v == 1 else [v_layout(p), linear_layout(p, 2)]
    c = as_costs(costs, lays[0])
    delays = [latency] * (p * v - 1)
    bound = makespan_bound(lays, m, c, delays)
    for cand in cands:
        if cand.fits:
            assert simulate(cand.schedule, costs, p2p_latency=latency).makespan >= bound * (1 - 1e-9)
    if v == 1:
        f, i, w = costs
        assert bound == pytest.approx(m * (f + i + w) + (p - 1) * (f + latency))


@settings(max_examples=15, deadline=None)
@given(p=st.integers(2, 6), v=st.integers(1, 2), data=st.data(), costs=st.tuples(POSITIVE, POSITIVE, POSITIVE),
       limits=st.lists(st.floats(1.0, 3.0), min_size=3, max_size=3))
def test_greedy_order_memo_answers_as_a_fresh_run(p, v, data, costs, limits):
    """greedy_order answers a repeated request under another limit from its memo only where the
    run would make the same comparisons: every answer equals a fresh, unmemoized run."""
    m = data.draw(st.integers(2, 3 * p))
    lay = linear_layout(p, 1) if v == 1 else v_layout(p)
    c = as_costs(costs, lay)
    act = [1.0 + 0.25 * (s % 3) for s in range(len(lay))]
    knobs = Knobs(prefer=data.draw(st.sampled_from(["I", "F"])), w_policy="fit")
    floor = max(sum(act[s] for s in range(len(lay)) if lay[s] == r) for r in range(p))
    for k in limits:
        limit = [k * p * floor / 2 + 0.25 * r for r in range(p)]
        got = greedy_order(lay, m, c, [0.1] * (len(lay) - 1), act, limit, knobs)
        fresh = _greedy_order(lay, m, c, [0.1] * (len(lay) - 1), act, limit, knobs, 0.5, None, None)
        assert (got is None) == (fresh is None)
        if got is not None:
            assert got.order == fresh.order and got.makespan == fresh.makespan
            # a cutoff below the run's makespan abandons it (memoized or not); at it, the run stands
            for run in (greedy_order, lambda *a, **k: _greedy_order(*a, 0.5, None, None, k["cutoff"])):
                assert run(lay, m, c, [0.1] * (len(lay) - 1), act, limit, knobs,
                           cutoff=fresh.makespan * 0.999) in (None, _ABANDONED)
                kept = run(lay, m, c, [0.1] * (len(lay) - 1), act, limit, knobs, cutoff=fresh.makespan)
                assert kept.order == fresh.order


# -- S2: zb-auto is never slower than the fixed schedule at the same memory -------------------

@settings(max_examples=12, deadline=None)
@given(p=st.integers(2, 16), data=st.data(), costs=st.tuples(POSITIVE, POSITIVE, POSITIVE),
       latency=st.sampled_from([0.0, 0.0, 0.2]))
def test_zb_auto_never_slower_than_1f1b_and_zb_h2(p, data, costs, latency):
    m = data.draw(st.integers(p, 4 * p))
    auto_p = simulate(build("zb-auto", p, m, costs=costs, memory_limit=p, p2p_latency=latency), costs,
                      p2p_latency=latency)
    one = simulate(build("1f1b", p, m), costs, p2p_latency=latency)
    assert auto_p.makespan <= one.makespan + EPS
    assert max(auto_p.peak_memory) <= p + EPS
    auto_2p = simulate(build("zb-auto", p, m, costs=costs, memory_limit=2 * p, p2p_latency=latency), costs,
                       p2p_latency=latency)
    h2 = simulate(build("zb-h2", p, m), costs, p2p_latency=latency)
    assert auto_2p.makespan <= h2.makespan + EPS
    assert max(auto_2p.peak_memory) <= 2 * p + EPS
    assert auto_2p.makespan <= auto_p.makespan + EPS  # more memory never hurts the search
