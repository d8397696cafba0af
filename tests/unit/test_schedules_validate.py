"""validate(), lower() and check_deadlock_free() on good and hand-broken schedules."""
import pytest

from autopar.schedules import Action, build, check_deadlock_free, lower, validate
from autopar.schedules.ir import make_schedule
from autopar.schedules.lower import Lowered


def A(text):
    return Action.parse(text)


def sched(rows, stage_to_rank=(0, 1), m=1, overlap=()):
    return make_schedule("t", len(rows), stage_to_rank, m, [[A(x) for x in row.split()] for row in rows], overlap)


def test_valid_minimal():
    assert validate(sched(["0F0 0B0", "1F0 1B0"])).name == "t"
    validate(sched(["0F0 0I0 0W0", "1F0 1I0 1W0"]))


@pytest.mark.parametrize("rows,msg", [
    (["0F0 0B0", "1B0"], "stage 1 microbatch 0 has no F"),
    (["0F0 0B0 0F0", "1F0 1B0"], r"0F0 appears twice \(rank 0 position 0 and rank 0 position 2\)"),
    (["0F0 0B0 1F0", "1B0"], "1F0 runs stage 1, which lives on rank 1"),
    (["0F0 0B0 0W0", "1F0 1B0"], "stage 0 microbatch 0 has both B and I/W"),
    (["0F0 0I0", "1F0 1B0"], r"stage 0 microbatch 0 has no complete backward \(0W0 missing\)"),
    (["0F0", "1F0 1B0"], r"stage 0 microbatch 0 has no complete backward \(0B0, or 0I0 and 0W0, missing\)"),
    (["0F0 0B0 0F2", "1F0 1B0"], "outside stages 0..1 / microbatches 0..0"),
    (["0F0 1SEND_F0 0B0", "1F0 1B0"], "is a communication action"),
])
def test_structural_errors(rows, msg):
    with pytest.raises(ValueError, match=msg):
        validate(sched(rows))


def test_forward_order_per_stage():
    with pytest.raises(ValueError, match="stage 0 runs F of microbatch 0 .* after microbatch 1"):
        validate(sched(["0F1 0F0 0B0 0B1", "1F0 1F1 1B0 1B1"], m=2))


def test_same_rank_dependency_order():
    with pytest.raises(ValueError, match="rank 0: 0W0 at position 1 comes before 0I0 at position 2"):
        validate(sched(["0F0 0W0 0I0", "1F0 1B0"]))
    # V layout: stage 1 and 2 share rank 1; 2F0 needs 1F0 first.
    with pytest.raises(ValueError, match="rank 1: 2F0 at position 0 comes before 1F0 at position 1"):
        validate(sched(["0F0 3F0 3B0 0B0", "2F0 1F0 2B0 1B0"], stage_to_rank=(0, 1, 1, 0)))


def test_cross_rank_deadlock_is_explained():
    # rank 0 waits in 0B0 for 1B0's gradient; rank 1 runs 1F1 before 1B0 and needs 0F1 first.
    with pytest.raises(ValueError, match=r"deadlock: rank 0 at position 1 \(0B0\) waits for I/B\(stage 1, mb 0\) "
                                         r"on rank 1; rank 1 at position 1 \(1F1\) waits for F\(stage 0, mb 1\)"):
        validate(sched(["0F0 0B0 0F1 0B1", "1F0 1F1 1B0 1B1"], m=2))


def test_overlap_unit_must_be_f_then_backward_of_other_stage():
    s = sched(["0F0 0B0", "1F0 1B0"], overlap=[(0,), ()])
    with pytest.raises(ValueError, match=r"overlap unit at position 0 is \(0F0, 0B0\)"):
        validate(s)


def test_lower_inserts_comm_only_across_ranks():
    s = build("1f1b", 2, 2)
    low = lower(s)
    assert [str(a) for a in low.actions[0]] == ["0F0", "0SEND_F0", "0F1", "0SEND_F1", "0RECV_B0", "0B0",
                                               "0RECV_B1", "0B1"]
    # 0F1 ends (and 0SEND_F1 is issued) when 1B0 starts, so 1RECV_F1 is posted before 1B0.
    assert [str(a) for a in low.actions[1]] == ["1RECV_F0", "1F0", "1RECV_F1", "1B0", "1SEND_B0", "1F1", "1B1",
                                               "1SEND_B1"]
    assert check_deadlock_free(low) is True


def test_lower_v_layout_skips_same_rank_handoffs():
    p, m = 4, 8
    low = lower(build("zbv", p, m))
    comm = [a for acts in low.actions for a in acts if not a.is_compute]
    # Boundaries crossing ranks: 0-1, 1-2, 2-3 (chunk 0) and 4-5, 5-6, 6-7 (chunk 1); 3-4 is on rank 3.
    # Each crossing carries m activations forward and m gradients back: send + recv each.
    assert len(comm) == 6 * m * 2 * 2
    assert not any(a.type in ("SEND_F", "SEND_B") and a.stage in (3, 4) and
                   ((a.type == "SEND_F" and a.stage == 3) or (a.type == "SEND_B" and a.stage == 4)) for a in comm)
    assert check_deadlock_free(low)


def test_receives_are_posted_early():
    # On rank 1 of 1f1b(p=2, m=4) the receive of microbatch 1's activation is posted before 1B0,
    # i.e. while rank 1 still computes, not just before 1F1 needs it.
    low = lower(build("1f1b", 2, 4))
    row = [str(a) for a in low.actions[1]]
    assert row.index("1RECV_F1") < row.index("1B0")


def test_lower_dualpipev_keeps_units_adjacent():
    d = build("dualpipev", 3, 6)
    low = lower(d)
    for r in range(3):
        for i in low.overlap[r]:
            assert low.actions[r][i].type == "F" and low.actions[r][i + 1].type in "BI"
    assert check_deadlock_free(low)


def test_deadlock_detector_catches_bad_receive_order():
    s = build("1f1b", 2, 2)
    low = lower(s)
    r1 = list(low.actions[1])
    # Post the receive of microbatch 1 before microbatch 0's: rank 1 then waits for 0SEND_F1,
    # which rank 0 issues only after 0F1 - fine; but move it after 1F1 and 1F1 lacks its input.
    i = r1.index(Action(1, "RECV_F", 1))
    moved = r1[:i] + r1[i + 1:]
    moved.insert(moved.index(Action(1, "F", 1)) + 1, Action(1, "RECV_F", 1))
    bad = Lowered(s, (low.actions[0], tuple(moved)))
    with pytest.raises(ValueError, match=r"rank 1 position \d+: 1F1 needs a RECV_F 1RECV_F1 before it"):
        check_deadlock_free(bad)


def test_deadlock_detector_catches_circular_wait():
    s = build("gpipe", 2, 1)
    # rank 0 receives the gradient before it sends the activation: both ranks block.
    a0 = (A("0F0"), A("0RECV_B0"), A("0SEND_F0"), A("0B0"))
    a1 = (A("1RECV_F0"), A("1F0"), A("1B0"), A("1SEND_B0"))
    with pytest.raises(ValueError, match="deadlocks: rank 0 blocks at position 1 on 0RECV_B0; rank 1 blocks at "
                                         "position 0 on 1RECV_F0"):
        check_deadlock_free(Lowered(s, (a0, a1)))


def test_deadlock_detector_unmatched():
    s = build("gpipe", 2, 1)
    a0 = (A("0F0"), A("0SEND_F0"), A("0RECV_B0"), A("0B0"))
    a1 = (A("1F0"), A("1B0"), A("1SEND_B0"))
    with pytest.raises(ValueError, match="2 sends but 1 receives"):
        check_deadlock_free(Lowered(s, (a0, a1)))
