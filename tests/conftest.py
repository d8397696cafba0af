"""Suite-wide settings: one intra-op thread (2-core CI machines; threads fighting cost 3x),
a CI hypothesis profile, the repository root on sys.path for `tests.models`, and the
multi-process tests that use the shared pools (tests/dist) in one pytest-xdist group: they run one after another on
one worker (sharing its pools of gloo processes, tests/dist/harness.py) while the other
worker runs the single-process tests (pyproject: ``-n 2 --dist loadgroup``)."""
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


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook turns the group markers into node ids
def pytest_collection_modifyitems(config, items):
    for item in items:
        path = str(item.fspath)
        # test_failures starts its own processes (ranks that die or hang): it needs no pool
        if os.sep + "dist" + os.sep in path and not path.endswith("test_failures.py"):
            item.add_marker(pytest.mark.xdist_group("dist"))


def pytest_sessionfinish(session, exitstatus):
    harness = sys.modules.get("tests.dist.harness")
    if harness is not None:  # this process ran multi-process tests: stop its pools of gloo processes
        harness.close_pools()
