"""runtime/offload.at_least: which saved values a stage parks at a share of its eligible bytes.

The planner prices exactly ``share x eligible bytes`` parked, so the runtime must park at least
that (else the run holds more than the plan said fits), and should not overshoot by more than one
value. Checked against a brute force over every subset: the chosen bytes reach the share, and
overshoot the smallest subset that reaches it by less than the largest value.
"""
import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from autopar.runtime.offload import at_least


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 1000), min_size=1, max_size=8), st.floats(0.0, 1.0))
def test_at_least_reaches_the_share_with_little_overshoot(sizes, fraction):
    named = {f"k{i}": n for i, n in enumerate(sizes)}
    chosen = at_least(named, fraction)
    assert len(set(chosen)) == len(chosen)
    total, budget = sum(named[k] for k in chosen), fraction * sum(sizes)
    assert total >= budget * (1 - 1e-9)
    best = min(sum(c) for r in range(len(sizes) + 1) for c in itertools.combinations(sizes, r)
               if sum(c) >= budget * (1 - 1e-9))
    assert total - best < max(sizes), (sizes, fraction, chosen)


def test_at_least_ends():
    named = {"a": 5, "b": 3, "c": 2}
    assert at_least(named, 0.0) == [] and sorted(at_least(named, 1.0)) == ["a", "b", "c"]
    assert at_least(named, 0.5) == ["a"] and sorted(at_least(named, 0.55)) == ["a", "c"]
