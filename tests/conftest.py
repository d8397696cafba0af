"""Suite-wide settings: one intra-op thread (2-core CI machines; threads fighting cost 3x),
a CI hypothesis profile, the repository root on sys.path for `tests.models`, and each
multi-process test file (tests/dist) in a pytest-xdist group of its own: its sub-cases run on
one worker, sharing that worker's pools of gloo processes (tests/dist/harness.py) and its
per-world runs (pyproject: ``-n 2 --dist loadgroup``; pytest < 9, whose node ids xdist's
loadgroup can still suffix: under pytest 9 the groups were silently ignored and every
per-world run ran on both workers)."""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

try:
    from hypothesis import HealthCheck, settings

    settings.register_profile("autopar", deadline=None, suppress_health_check=[HealthCheck.too_slow])
    settings.load_profile("autopar")
except ImportError:  # pragma: no cover - hypothesis is in the test extra
    pass


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    import torch

    torch.set_num_threads(1)
    yield


def pytest_itemcollected(item):
    # One xdist group per multi-process test file: a file's sub-cases share per-world runs (one
    # run serves all its parametrized cases), so they must run on one worker; different files
    # may run on both workers, each with its own pools. test_failures starts its own processes
    # (ranks that die or hang): it needs no pool.
    path = str(item.fspath)
    if os.sep + "dist" + os.sep in path and not path.endswith("test_failures.py"):
        item.add_marker(pytest.mark.xdist_group("dist_" + os.path.basename(path).removesuffix(".py")))


def pytest_sessionfinish(session, exitstatus):
    harness = sys.modules.get("tests.dist.harness")
    if harness is not None:  # this process ran multi-process tests: stop its pools of gloo processes
        harness.close_pools()
