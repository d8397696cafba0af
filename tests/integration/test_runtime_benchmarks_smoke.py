"""Smoke test of benchmarks/pp_vs_torch.py (R4) and benchmarks/schedule_speedup.py (R5) at tiny sizes.

Each script runs as its own process (it spawns 2 gloo ranks itself): it must exit 0 and print
its ratio lines. Timings are not checked here (at these sizes overheads dominate); only that
the scripts work and, for R4, that autopar's and torch's first-step losses agree.
"""
import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NUM = r"\d+\.\d+"


def _run(script: str, args: list[str], timeout: float = 80.0) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", script), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    return proc.stdout


def test_pp_vs_torch_runs():
    out = _run("pp_vs_torch.py", ["--layers", "4", "--d-model", "32", "--heads", "2", "--seq", "16", "--batch", "8",
                                  "-m", "4", "--steps", "2", "--warmup", "0", "--deadline", "75"])
    for kind, target in (("1f1b", "1.00"), ("zbv", "0.90")):
        assert re.search(rf"^\[{kind}\] first-step loss: autopar {NUM}, torch {NUM}, rel diff \S+ \(OK", out, re.M), out
        assert re.search(rf"^RATIO {kind} autopar/torch = {NUM} \(target <= {re.escape(target)}: (MET|NOT MET)\)$",
                         out, re.M), out
    assert "MISMATCH" not in out


def test_schedule_speedup_runs():
    out = _run("schedule_speedup.py", ["--layers", "2", "--d-model", "32", "--heads", "2", "--seq", "16",
                                       "--batch", "8", "-m", "4", "--steps", "2", "--warmup", "0",
                                       "--cost-steps", "1", "--pings", "3", "--deadline", "75"])
    for name in ("zb-h1", "zbv"):
        assert re.search(rf"^RATIO {name}/1f1b predicted {NUM} measured {NUM} disagreement {NUM}% "
                         r"\(target <= 15%: (MET|NOT MET)\)$", out, re.M), out
    for name in ("1f1b", "zb-h1", "zbv"):
        assert re.search(rf"^\[{name}\] predicted makespan {NUM} ms", out, re.M), out
