"""Generators: registry, constraints, and the exact orders of the fixed schedules."""
import re

import pytest

from autopar.schedules import build, default_stages_per_rank, names, peak_memory, simulate, validate
from autopar.schedules.registry import GENERATORS, layout, screen_bubble

ALL = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zb-auto", "zbv", "v-half", "v-min", "dualpipev")


def _row(s, r):
    return " ".join(map(str, s.actions[r]))


def test_registry_names_and_defaults():
    assert names() == ALL
    assert {n: default_stages_per_rank(n) for n in ALL} == {
        "gpipe": 1, "1f1b": 1, "interleaved-1f1b": 2, "zb-h1": 1, "zb-h2": 1, "zb-auto": 1,
        "zbv": 2, "v-half": 2, "v-min": 2, "dualpipev": 2}
    with pytest.raises(ValueError, match="unknown schedule 'nope'; known: gpipe, 1f1b"):
        default_stages_per_rank("nope")


def test_1f1b_last_rank_runs_microbatch_0_first():
    s = build("1f1b", 4, 8)
    assert _row(s, 3) == "3F0 3B0 3F1 3B1 3F2 3B2 3F3 3B3 3F4 3B4 3F5 3B5 3F6 3B6 3F7 3B7"
    assert _row(s, 0) == "0F0 0F1 0F2 0F3 0B0 0F4 0B1 0F5 0B2 0F6 0B3 0F7 0B4 0B5 0B6 0B7"


def test_gpipe_order():
    s = build("gpipe", 2, 3)
    assert _row(s, 1) == "1F0 1F1 1F2 1B0 1B1 1B2"


def test_interleaved_1f1b_megatron_order():
    s = build("interleaved-1f1b", 2, 4)  # v=2: warm-up 2*(p-1-r) + (v-1)*p = 4 on rank 0, 2 on rank 1
    assert s.stage_to_rank == (0, 1, 0, 1)
    assert _row(s, 0) == "0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3"
    assert _row(s, 1) == "1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3"


def test_zb_h1_defers_w_by_rank():
    s = build("zb-h1", 3, 4)
    assert _row(s, 0) == "0F0 0F1 0F2 0I0 0W0 0F3 0I1 0W1 0I2 0W2 0I3 0W3"
    assert _row(s, 2) == "2F0 2I0 2F1 2I1 2F2 2I2 2W0 2F3 2I3 2W1 2W2 2W3"


def test_zbv_and_dualpipev_first_rank():
    z = build("zbv", 2, 4)
    assert z.stage_to_rank == (0, 1, 1, 0)
    assert _row(z, 0) == "0F0 0F1 0F2 3F0 3I0 3W0 3F1 3I1 3W1 0F3 0I0 0W0 3F2 3I2 3W2 0I1 0W1 3F3 3I3 3W3 " \
                         "0I2 0W2 0I3 0W3"
    d = build("dualpipev", 2, 4)  # same order as torch's ScheduleDualPipeV (checked in the benchmark)
    # Rank 1 (the bottom of the V) runs its first (F, B) pair back to back, then F&B units.
    assert _row(d, 1) == "1F0 2F0 1F1 2F1 1F2 2B0 2F2 1B0 1F3 2B1 2F3 1B1 2B2 1B2 2I3 1I3 2W3 1W3"
    assert d.overlap[1] == (6, 8, 10)
    assert _row(d, 0) == "0F0 0F1 0F2 3F0 3I0 3W0 3F1 0F3 3B1 3F2 0B0 3B2 3F3 0B1 3B3 0I2 0W2 0I3 0W3"
    assert d.overlap[0] == (7, 9, 12)
    assert {a.type for acts in d.actions for a in acts} == {"F", "B", "I", "W"}


def test_v_min_building_block_order():
    s = build("v-min", 2, 2)
    # Slots of F/2: F(s,k) at 6k+s, I(s,k) at 6k+2p+(2p-1-s); W in the next free slot. Rank 0:
    # F(0,0)@0 F(3,0)@3 I(3,0)@4 W@5 F(0,1)@6 I(0,0)@7 W@8 F(3,1)@9 I(3,1)@10 W@11 I(0,1)@13 W@14.
    assert _row(s, 0) == "0F0 3F0 3I0 3W0 0F1 0I0 0W0 3F1 3I1 3W1 0I1 0W1"


def test_split_and_fused_backward_kinds():
    fused = ("gpipe", "1f1b", "interleaved-1f1b")
    for name in ALL:
        m = 8
        s = build(name, 4, m)
        kinds = {a.type for acts in s.actions for a in acts}
        if name in fused:
            assert kinds == {"F", "B"}, name
        elif name == "dualpipev":
            assert kinds == {"F", "B", "I", "W"}
        else:
            assert kinds == {"F", "I", "W"}, name


@pytest.mark.parametrize("name", ["zbv", "v-half", "v-min", "dualpipev"])
def test_v_schedules_put_two_stages_per_rank_in_a_v(name):
    s = build(name, 5, 10)
    assert s.num_stages == 10
    for r in range(5):
        assert s.stages_of(r) == (r, 9 - r)


@pytest.mark.parametrize("name,pp,m,v,msg", [
    ("1f1b", 4, 2, None, "1f1b needs num_microbatches >= pp: got m=2 < pp=4; use at least 4 microbatches"),
    ("zbv", 4, 7, None,
     re.escape("zbv needs num_microbatches >= 2*pp to fill the V: got m=7 < 2*pp=8; use at least 8")),
    ("dualpipev", 3, 5, None, re.escape("dualpipev needs num_microbatches >= 2*pp to fill the V: got m=5 < 2*pp=6")),
    ("interleaved-1f1b", 4, 6, None, "needs num_microbatches divisible by pp .*got m=6, pp=4; use 4 or 8"),
    ("interleaved-1f1b", 4, 8, 1, "interleaved-1f1b needs stages_per_rank >= 2: got 1"),
    ("zbv", 4, 8, 3, r"zbv needs stages_per_rank == 2 \(a V: rank r holds stages r and 2\*pp-1-r\): got 3"),
    ("gpipe", 4, 8, 2, "gpipe needs stages_per_rank == 1"),
    ("zb-h1", 4, 6, 2, "divisible by pp"),
    ("zb-h1", 4, 3, 1, "zb-h1 needs num_microbatches >= pp: got m=3 < pp=4"),
    ("zb-auto", 4, 8, 3, "zb-auto needs stages_per_rank 1 .* or 2 .*got 3"),
    ("1f1b", 0, 8, None, "1f1b needs pp to be an int >= 1: got 0"),
    ("1f1b", 2, 2.5, None, "needs num_microbatches to be an int >= 1"),
])
def test_constraint_errors_name_the_numbers(name, pp, m, v, msg):
    with pytest.raises(ValueError, match=msg):
        build(name, pp, m, stages_per_rank=v)


def test_memory_limit_rejects_fixed_schedule_above_it():
    with pytest.raises(ValueError, match=r"1f1b needs 4 M_B per rank at peak .* above the memory limit 3"):
        build("1f1b", 4, 8, memory_limit=3)
    assert build("v-min", 4, 8, memory_limit=2).name == "v-min"


def test_zb_auto_memory_limit_below_one_microbatch():
    with pytest.raises(ValueError, match="below the 1 M_B one microbatch needs on rank 0"):
        build("zb-auto", 4, 8, memory_limit=0.9)


def test_zb_auto_respects_limit_and_bytes():
    s = build("zb-auto", 4, 8, costs=(1.0, 1.2, 0.8), memory_limit=2)
    assert max(peak_memory(s)) <= 2 + 1e-9
    assert all(a.type in "FIW" for acts in s.actions for a in acts)
    # bytes: stage 0 keeps 300 bytes per microbatch, the others 100; limit 600 bytes per rank.
    sb = (300.0, 100.0, 100.0, 100.0)
    s = build("zb-auto", 4, 8, costs=(1, 1, 1), memory_limit=600, stage_bytes=sb)
    peaks = peak_memory(s, stage_bytes=sb)
    assert max(peaks) <= 600
    assert peaks[0] >= 300
    with pytest.raises(ValueError, match="below the 300 bytes one microbatch needs on rank 0"):
        build("zb-auto", 4, 8, memory_limit=299, stage_bytes=sb)


def test_zb_auto_v_layout_beats_one_stage_per_rank_at_equal_memory():
    one = simulate(build("zb-auto", 4, 8, costs=(1, 1, 1)), (1, 1, 1)).makespan
    vee = simulate(build("zb-auto", 4, 8, stages_per_rank=2, costs=(1, 1, 1)), (1, 1, 1)).makespan
    assert one == pytest.approx(27.0)  # 3m + (p-1)F: the single-step bound for one stage per rank
    assert vee == pytest.approx(25.5)  # 3m + (p-1)F/2


def test_every_fixed_generator_validates_small_grid():
    for name, gen in GENERATORS.items():
        for pp in (1, 2, 3):
            for m in range(1, 4 * pp + 1):
                try:
                    s = build(name, pp, m)
                except ValueError:
                    continue
                validate(s)
                assert max(peak_memory(s)) <= gen.peak_bound(pp, m, s.stages_per_rank) + 1e-9, (name, pp, m)


def test_builds_are_cached_and_immutable():
    assert build("zbv", 4, 8) is build("zbv", 4, 8)
    with pytest.raises(AttributeError):
        build("zbv", 4, 8).pp = 3


def test_layout_is_the_built_schedules_stage_to_rank():
    for name in ALL:
        for pp in (2, 3, 4):
            for v in (1, 2, 3):
                if name == "zb-auto" and v == 2:
                    continue  # its search returns the V or the interleaved layout, whichever is faster
                try:
                    s = build(name, pp, 4 * pp, stages_per_rank=v)
                except ValueError:
                    continue
                assert layout(name, pp, v) == s.stage_to_rank, (name, pp, v)
    assert layout("zb-auto", 4, 2) == (0, 1, 2, 3, 3, 2, 1, 0)  # the V
    assert layout("interleaved-1f1b", 2, 3) == (0, 1, 0, 1, 0, 1)


@pytest.mark.parametrize("name,v,costs,bubble", [
    ("gpipe", 1, (1, 1, 1), 9.0),  # (p-1)(F+I+W) at p = 4
    ("1f1b", 1, (1, 2, 3), 18.0),
    ("interleaved-1f1b", 3, (1, 1, 1), 3.0),  # (p-1)(F+I+W)/v
    ("zb-h1", 1, (1, 1, 1), 3.0),  # (p-1)(F+I-W)
    ("zb-h1", 1, (1, 1, 3), 0.0),  # W covers the whole bubble
    ("zbv", 2, (2, 1, 1), 3.0),  # (p-1)F/2
    ("v-half", 2, (1, 1, 1), 4.5),
    ("zb-auto", 1, (1, 1, 1), 0.9),
])
def test_screen_bubble_by_hand(name, v, costs, bubble):
    assert screen_bubble(name, 4, v, *costs) == pytest.approx(bubble)
