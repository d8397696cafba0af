"""Action IR and schedule JSON (design.md §4)."""
import json

import pytest

from autopar.schedules import Action, Schedule, build
from autopar.schedules.ir import linear_layout, v_layout


def test_action_string_form_matches_torch_pipelining():
    assert str(Action(0, "F", 1)) == "0F1"
    assert str(Action(5, "W", 0)) == "5W0"
    assert str(Action(1, "SEND_F", 3)) == "1SEND_F3"
    assert str(Action(2, "RECV_B", 0)) == "2RECV_B0"
    assert str(Action(12, "I", 34)) == "12I34"


@pytest.mark.parametrize("text", ["0F1", "5W0", "5I0", "3B12", "1SEND_F3", "2RECV_B0", "10RECV_F7", "4SEND_B9"])
def test_action_parse_round_trip(text):
    a = Action.parse(text)
    assert str(a) == text


def test_action_parse_fields():
    assert Action.parse("5W0") == Action(5, "W", 0)
    assert Action.parse("1SEND_F3") == Action(1, "SEND_F", 3)
    assert Action.parse("12RECV_B40") == Action(12, "RECV_B", 40)


@pytest.mark.parametrize("bad", ["F1", "0X1", "0F", "-1F0", "0 F 1", "0SEND1", ""])
def test_action_parse_rejects(bad):
    with pytest.raises(ValueError, match="cannot parse action"):
        Action.parse(bad)


def test_action_rejects_bad_fields():
    with pytest.raises(ValueError, match="type must be one of"):
        Action(0, "Z", 0)
    with pytest.raises(ValueError, match="stage"):
        Action(-1, "F", 0)


def test_layouts():
    assert linear_layout(4, 2) == (0, 1, 2, 3, 0, 1, 2, 3)
    assert v_layout(4) == (0, 1, 2, 3, 3, 2, 1, 0)


def test_schedule_json_exact_keys_and_round_trip():
    s = build("1f1b", 2, 3)
    data = json.loads(s.to_json())
    assert data == {
        "schedule": "1f1b", "pp": 2, "stages": 2, "microbatches": 3, "stage_to_rank": [0, 1],
        "actions": [["0F0", "0F1", "0B0", "0F2", "0B1", "0B2"], ["1F0", "1B0", "1F1", "1B1", "1F2", "1B2"]],
    }
    assert Schedule.from_json(s.to_json()) == s
    assert Schedule.from_json(data) == s


def test_schedule_json_round_trip_v_and_overlap():
    for name in ("zbv", "dualpipev", "v-min"):
        s = build(name, 3, 6)
        back = Schedule.from_json(s.to_json())
        assert back == s
        assert back.stage_to_rank == (0, 1, 2, 2, 1, 0)
    d = json.loads(build("dualpipev", 3, 6).to_json())
    assert "overlap" in d and len(d["overlap"]) == 3 and all(d["overlap"])  # extra key, every rank overlaps


def test_schedule_from_json_missing_key():
    with pytest.raises(ValueError, match="lacks key"):
        Schedule.from_json({"schedule": "x", "pp": 1})


def test_stages_of():
    s = build("zbv", 4, 8)
    assert s.stages_of(0) == (0, 7)
    assert s.stages_of(3) == (3, 4)
    s = build("interleaved-1f1b", 4, 8, stages_per_rank=3)
    assert s.stages_of(1) == (1, 5, 9)
    assert s.stages_per_rank == 3


def test_schedule_shape_errors():
    with pytest.raises(ValueError, match="stage_to_rank has 3 entries for 2 stages"):
        Schedule("x", 2, 2, (0, 1, 1), 1, ((), ()))
    with pytest.raises(ValueError, match="1 action lists for pp=2"):
        Schedule("x", 2, 2, (0, 1), 1, ((),))
    with pytest.raises(ValueError, match="outside 0..1"):
        Schedule("x", 2, 2, (0, 2), 1, ((), ()))
