"""Lowered actions -> runtime primitive calls (runtime/actions.py) and the generated step code."""
import pytest

from autopar.runtime.actions import calls, interpret
from autopar.runtime.codegen import compile_step, generate_source
from autopar.schedules import build, lower
from autopar.schedules.ir import Action, v_layout

V2 = v_layout(2)  # (0, 1, 1, 0): stages 1 and 2 share rank 1, stages 0 and 3 rank 0


def _names(text, rank):
    return [(c.primitive, c.args) for c in calls(Action.parse(text), V2, rank)]


@pytest.mark.parametrize("text,rank,expected", [
    ("0F0", 0, [("forward", (0, 0))]),
    ("1F0", 1, [("wait_f", (1, 0)), ("forward", (1, 0))]),
    ("2F0", 1, [("forward", (2, 0))]),  # stage 1 is on the same rank: handed over, no wait
    ("3F0", 0, [("wait_f", (3, 0)), ("forward", (3, 0))]),
    ("3B0", 0, [("backward", (3, 0, "B"))]),  # the last stage starts from its loss
    ("2I0", 1, [("wait_b", (2, 0)), ("backward", (2, 0, "I"))]),
    ("1B0", 1, [("backward", (1, 0, "B"))]),  # stage 2's gradient is on the same rank
    ("0I1", 0, [("wait_b", (0, 1)), ("backward", (0, 1, "I"))]),
    ("0W1", 0, [("weight", (0, 1))]),
    ("0SEND_F0", 0, [("send_f", (0, 0))]),
    ("1SEND_B0", 1, [("send_b", (1, 0))]),
    ("1RECV_F0", 1, [("recv_f", (1, 0))]),
    ("0RECV_B0", 0, [("recv_b", (0, 0))]),
])
def test_calls_by_hand(text, rank, expected):
    assert _names(text, rank) == expected


def test_generated_source_by_hand():
    low = lower(build("gpipe", 2, 1))
    assert generate_source(low.actions[1], (0, 1), 1) == (
        "def step(rt):\n"
        "    # pipeline rank 1: 2 compute actions, 2 communication actions\n"
        "    rt.recv_f(1, 0)  # post receive: activations for 1F0\n"
        "    rt.wait_f(1, 0)\n"
        "    rt.forward(1, 0)\n"
        "    rt.backward(1, 0, 'B')\n"
        "    rt.send_b(1, 0)  # to rank 0\n")


class _Recorder:
    """Records every primitive call, as the generated code and the interpreter make them."""

    def __init__(self):
        self.log = []

    def __getattr__(self, name):
        return lambda *args: self.log.append((name, args))


@pytest.mark.parametrize("name,pp,m", [("zbv", 2, 4), ("dualpipev", 2, 4), ("interleaved-1f1b", 2, 2)])
def test_generated_step_makes_the_interpreters_calls(name, pp, m):
    s = build(name, pp, m)
    low = lower(s)
    for r in range(pp):
        ran, interpreted = _Recorder(), _Recorder()
        compile_step(generate_source(low.actions[r], s.stage_to_rank, r))(ran)
        interpret(interpreted, low.actions[r], s.stage_to_rank, r)
        assert ran.log == interpreted.log and ran.log
