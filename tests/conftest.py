"""Suite-wide settings: one intra-op thread (2-core CI machines; threads fighting cost 3x),
a CI hypothesis profile, and the repository root on sys.path for `tests.models`."""
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
