"""The live-tensor memory probe on known cases, and smoke runs of the planner benchmarks
(benchmarks/memory_model.py: P3, benchmarks/cost_model.py: P4) at tiny sizes.

The benchmark runs only check that the scripts complete and print their tables and verdict
lines; their targets are not asserted (timing on a shared machine is noisy, and tiny models
are all overhead).
"""
import gc
import os
import re
import subprocess
import sys

import pytest
import torch

from autopar.runtime.memory_probe import PeakTensorMemory, storage_bytes

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MiB = 2 ** 20
NUM = r"[-+]?\d+\.\d+"


def test_probe_peak_of_sequential_allocations():
    torch.set_num_threads(1)
    keep = torch.zeros(MiB // 4)  # 1 MiB, alive throughout
    with PeakTensorMemory([keep, keep[10:]]) as probe:  # a view of it counts once
        assert probe.baseline_bytes == MiB
        a = torch.empty(MiB // 4)  # 1 MiB
        del a                      # freed: back to the baseline
        assert probe.live_bytes == MiB
        b = torch.empty(MiB // 2)  # 2 MiB
        v = b.view(2, -1)          # a view adds nothing
        assert probe.live_bytes == 3 * MiB
        del b, v
        assert probe.live_bytes == MiB
    assert probe.peak_bytes == 3 * MiB  # 2 MiB + baseline, not 1 + 2 + baseline


def test_probe_counts_tensors_kept_alive_and_freed_baseline():
    x = torch.ones(MiB // 4)
    g = torch.ones(MiB // 4)
    baseline = [x, g]
    with PeakTensorMemory(baseline) as probe:
        del baseline
        kept = x * 2          # 1 MiB kept past the window
        del g                 # a baseline tensor freed inside the window: subtracted
        gc.collect()
        assert probe.live_bytes == 2 * MiB
    assert probe.peak_bytes == 3 * MiB
    assert kept.sum().item() == 2 * (MiB // 4)


def test_probe_sees_autograd_and_inplace_resize():
    w = torch.randn(256, 256, requires_grad=True)  # 256 KiB
    with PeakTensorMemory([w]) as probe:
        loss = (w * 2).sum()
        loss.backward()        # w.grad: 256 KiB, made by the autograd engine through dispatch
        out = torch.empty(0)
        torch.add(w.detach(), 1, out=out)  # resized in place to 256 KiB
        out.add_(1)
    assert probe.peak_bytes >= 3 * 256 * 1024
    assert storage_bytes([w, w.grad, w.grad[0]]) == 2 * 256 * 1024


def _run(script: str, args: list[str], timeout: float = 120.0) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", script), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


TINY = ["--layers", "2", "--d-model", "32", "--heads", "2", "--seq", "16", "--batch", "4", "--deadline", "100"]


@pytest.mark.slow
def test_memory_model_benchmark_runs():
    out = _run("memory_model.py", TINY + ["--plans", "1f1b:2,zb-h1:2"])
    for label in ("pp=2 dp=1 1f1b m=2", "pp=2 dp=1 zb-h1 m=2"):
        assert f"[{label}]" in out, out
    rows = re.findall(rf"^\s+[01]\s+{NUM}\s+{NUM}\s+{NUM}%", out, re.M)
    assert len(rows) == 4, out  # 2 plans x 2 ranks: predicted, measured, error
    assert "rank 0 predicted (MiB): weights" in out
    assert re.search(r"^P3 memory model: (PASS|FAIL) ", out, re.M), out


@pytest.mark.slow
def test_cost_model_benchmark_runs():
    out = _run("cost_model.py", TINY + ["--plans", "1f1b:2,gpipe:4,1f1b:2:pp=1:dp=2:zero=1", "--steps", "2",
                                        "--warmup", "1"])
    for label in ("pp=2 dp=1 1f1b m=2", "pp=2 dp=1 gpipe m=4", "pp=1 dp=2 1f1b m=2 zero=1"):
        assert re.search(rf"^{re.escape(label)}\s+{NUM}\s+{NUM} \+ {NUM} \+ {NUM}\s+{NUM}\s+{NUM}%", out, re.M), out
    assert re.search(rf"^Spearman rank correlation {NUM} \(target >= 0.8: (PASS|FAIL)\)$", out, re.M), out
    assert re.search(rf"^median absolute error {NUM}% \(target <= 25%: (PASS|FAIL)\)", out, re.M), out
