"""The dependency rule (schedules/deps.py) against hand-written and brute-force oracles."""
import itertools

import pytest

from autopar.schedules.deps import needs, producers, produces
from autopar.schedules.ir import COMPUTE_TYPES, Action


def A(text):
    return Action.parse(text)


@pytest.mark.parametrize("action,expected", [
    ("0F0", ()),  # the first stage reads data only
    ("2F1", ((1, "F", 1),)),
    ("1I0", ((1, "F", 0), (2, "G", 0))),
    ("1B3", ((1, "F", 3), (2, "G", 3))),
    ("2B0", ((2, "F", 0),)),  # the last stage starts from the loss
    ("2I4", ((2, "F", 4),)),
    ("0W2", ((0, "I", 2),)),
])
def test_needs_by_hand(action, expected):
    assert needs(A(action), 3) == expected


@pytest.mark.parametrize("action,expected", [
    ("1F0", ((1, "F", 0),)),
    ("1I2", ((1, "G", 2), (1, "I", 2))),
    ("1B2", ((1, "G", 2),)),
    ("1W2", ()),
])
def test_produces_by_hand(action, expected):
    assert produces(A(action)) == expected


def test_producers_by_hand():
    assert producers((1, "F", 0)) == (A("1F0"),)
    assert producers((1, "G", 0)) == (A("1I0"), A("1B0"))
    assert producers((1, "I", 0)) == (A("1I0"),)


@pytest.mark.parametrize("text", ["1SEND_F0", "1RECV_B0"])
def test_communication_actions_have_no_dependencies(text):
    with pytest.raises(ValueError, match="communication action"):
        needs(A(text), 3)
    with pytest.raises(ValueError, match="communication action"):
        produces(A(text))


def _rule(b: Action, a: Action) -> bool:
    """The issue's action-level rule: must b run before a? (written without keys)."""
    same_mb = a.microbatch == b.microbatch
    backward = ("I", "B")
    return same_mb and (
        (a.type == "F" and b.type == "F" and b.stage == a.stage - 1)
        or (a.type in backward and b.type == "F" and b.stage == a.stage)
        or (a.type in backward and b.type in backward and b.stage == a.stage + 1)
        or (a.type == "W" and b.type == "I" and b.stage == a.stage))


def test_needs_and_produces_match_the_action_rule_exhaustively():
    S, m = 4, 2
    acts = [Action(s, t, k) for s in range(S) for t in COMPUTE_TYPES for k in range(m)]
    for a, b in itertools.product(acts, acts):
        linked = bool(set(needs(a, S)) & set(produces(b)))
        assert linked == _rule(b, a), (b, a)
    for a in acts:  # every key an action needs has a producer, so every action can run eventually
        assert all(producers(key) for key in needs(a, S)), a
