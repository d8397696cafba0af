"""The live-tensor memory probe on known cases, and smoke runs of the planner benchmarks
(benchmarks/memory_model.py: P3, benchmarks/cost_model.py: P4) at tiny sizes.

The benchmarks' targets are not asserted (timing on a shared machine is noisy, and tiny models
are all overhead). What is checked can fail for a real reason: P3's predicted weights,
gradients and optimizer states equal the measured ones, and the measured weights add up to the
model's parameter count; P4's predicted pipeline makespan is within bounds derived from the
stage costs it prints (exactly m x (F + I + W) on one stage); every error, median, Spearman
correlation and verdict printed is the one the printed numbers give (to their rounding).
"""
import gc
import os
import re
import statistics
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



def _bounds(text: str) -> tuple[float, float]:
    """The interval a printed number was rounded from (half a unit of its last digit around it)."""
    half = 0.5 * 10.0 ** -len(text.split(".")[1]) if "." in text else 0.5
    return float(text) - half, float(text) + half


def _agrees(printed: str, lo_hi) -> bool:
    """The printed value could be the rounding of a value in [lo, hi]."""
    plo, phi = _bounds(printed)
    return plo <= lo_hi[1] + 1e-12 and lo_hi[0] - 1e-12 <= phi


def _error_bounds(pred: str, meas: str) -> tuple[float, float]:
    """100 (p - m) / m over the rounding box of p and m (increasing in p, decreasing in m)."""
    (plo, phi), (mlo, mhi) = _bounds(pred), _bounds(meas)
    return 100 * (plo - mhi) / mhi, 100 * (phi - mlo) / mlo


def _diff_bounds(a: str, b: str) -> tuple[float, float]:
    (alo, ahi), (blo, bhi) = _bounds(a), _bounds(b)
    return alo - bhi, ahi - blo


def _abs_median_bounds(errors: list[str], pick=statistics.median) -> tuple[float, float]:
    """Bounds of median (or max) of |e| over the printed errors e (percent, increasing in each |e|)."""
    b = [_bounds(e) for e in errors]
    lo = [0.0 if x <= 0 <= y else min(abs(x), abs(y)) for x, y in b]
    hi = [max(abs(x), abs(y)) for x, y in b]
    return pick(lo), pick(hi)


TINY = ["--layers", "2", "--d-model", "32", "--heads", "2", "--seq", "16", "--batch", "4", "--deadline", "100"]
TINY_MODEL = dict(n_layer=2, d_model=32, n_head=2, seq_len=16, batch_size=4, vocab_size=256, seed=0)


def _param_count() -> int:
    from autopar.examples.gpt import make_gpt

    return sum(p.numel() for p in make_gpt(**TINY_MODEL)[0].parameters())  # the tied embedding / head once


@pytest.mark.slow
def test_memory_model_benchmark_runs():
    out = _run("memory_model.py", TINY + ["--plans", "1f1b:2,zb-h1:2"])
    n_params = _param_count()
    tied = TINY_MODEL["vocab_size"] * TINY_MODEL["d_model"]
    mib = lambda n: 4 * n / MiB  # noqa: E731 - fp32 bytes of n elements, in MiB
    # the planner's profile holds the model's parameters
    assert re.search(rf"^planner: profiled gpt on one microbatch of \d+ in {NUM} s \(\d+ units, {n_params} "
                     r"parameters\)", out, re.M), out
    blocks = re.split(r"^\[", out, flags=re.M)[1:]
    assert [b.split("]")[0] for b in blocks] == ["pp=2 dp=1 1f1b m=2", "pp=2 dp=1 zb-h1 m=2"], out
    errors, marks = [], []
    for block in blocks:
        rows = re.findall(rf"^\s+([01])\s+({NUM})\s+({NUM})\s+({NUM})%\s+({NUM})\s+({NUM})\s+({NUM})\s+({NUM})"
                          r"\s+(ok|MISS)$", block, re.M)
        assert [r[0] for r in rows] == ["0", "1"], block
        for _r, pred, meas, err, base, above, static, pred_above, mark in rows:
            # error = (predicted - measured) / measured, the splits into baseline + above, the mark
            assert _agrees(err, _error_bounds(pred, meas)), (block, err)
            assert _agrees(above, _diff_bounds(meas, base)), block
            assert _agrees(pred_above, _diff_bounds(pred, static)), block
            e = float(err)
            if abs(e) not in (15.0, 5.0):
                assert mark == ("ok" if abs(e) <= 15 and e >= -5 else "MISS"), (block, err, mark)
            errors.append(err)
            marks.append(mark)
        measured = {}
        for r in "01":
            p = re.search(rf"^\s+rank {r} predicted \(MiB\): weights ({NUM}), gradients ({NUM}), "
                          rf"optimizer ({NUM}),", block, re.M)
            m = re.search(rf"^\s+rank {r} measured at entry \(MiB\): weights ({NUM}), gradients ({NUM}), optimizer "
                          rf"({NUM}); stages \[{r}\]; unused model copy ({NUM}) \(not counted\)$", block, re.M)
            assert p and m, block
            # the planner's parameter, gradient and Adam-state bytes of this rank = the tensors it holds
            for pred, got in zip(p.groups(), m.groups()[:3]):
                assert abs(float(pred) - float(got)) <= 0.01 + 1e-9, (r, p.groups(), m.groups())
            w, g, o, unused = m.groups()
            # from the model: this rank's weights + the other rank's (untouched) = every parameter;
            # a gradient per weight; Adam's exp_avg and exp_avg_sq per weight (its step counters are scalars)
            assert _bounds(w)[0] + _bounds(unused)[0] <= mib(n_params) <= _bounds(w)[1] + _bounds(unused)[1], m.groups()
            assert abs(float(g) - float(w)) <= 0.01 + 1e-9 and abs(float(o) - 2 * float(w)) <= 0.015 + 1e-9, m.groups()
            # the probe's baseline at entry is those three tensors' storages
            base = next(row[4] for row in rows if row[0] == r)
            assert _agrees(base, (sum(_bounds(x)[0] for x in (w, g, o)), sum(_bounds(x)[1] for x in (w, g, o)))), block
            measured[r] = w
        # both ranks together: every parameter once, and the tied embedding / head on both (rank 0
        # holds the embedding's stage, rank 1 the head's; one Parameter each, gradients summed)
        lo = sum(_bounds(measured[r])[0] for r in "01")
        hi = sum(_bounds(measured[r])[1] for r in "01")
        assert lo <= mib(n_params + tied) <= hi, (measured, mib(n_params + tied))
    # the worst errors are the extremes of the rows' (the over-prediction at least 0, the under-prediction
    # "none" when no row is below 0)
    worst = re.search(rf"^worst over-prediction ({NUM})%, worst under-prediction (none|{NUM}%)$", out, re.M)
    assert worst, out
    lo, hi = [_bounds(e)[0] for e in errors], [_bounds(e)[1] for e in errors]
    assert _agrees(worst.group(1), (max(0.0, max(lo)), max(0.0, max(hi)))), (worst.group(0), errors)
    if worst.group(2) == "none":
        assert all(h >= 0 for h in hi), errors
    else:
        assert _agrees(worst.group(2)[:-1], (min(lo), min(hi))), (worst.group(0), errors)
    verdict = re.search(r"^P3 memory model: (PASS|FAIL) ", out, re.M)
    assert verdict and verdict.group(1) == ("PASS" if all(m == "ok" for m in marks) else "FAIL"), (verdict, marks)


def _spearman(x: list[float], y: list[float]) -> float:
    from scipy.stats import spearmanr

    return float(spearmanr(x, y).statistic)


@pytest.mark.slow
def test_cost_model_benchmark_runs():
    plans = {"pp=2 dp=1 1f1b m=2": 2, "pp=2 dp=1 gpipe m=4": 4, "pp=1 dp=2 1f1b m=2 zero=1": 2}
    out = _run("cost_model.py", TINY + ["--plans", "1f1b:2,gpipe:4,1f1b:2:pp=1:dp=2:zero=1", "--steps", "2",
                                        "--warmup", "1", "--actions"])
    rows = {}
    for label, m in plans.items():
        row = re.search(rf"^{re.escape(label)}\s+({NUM})\s+({NUM}) \+ ({NUM}) \+ ({NUM})\s+({NUM})\s+({NUM})%\s+({NUM})"
                        rf"  ([\d., ]+)$", out, re.M)
        assert row, out
        pred, makespan, _sync, _opt, meas, err, before, steps = row.groups()
        steps = steps.split(", ")
        assert len(steps) == 2, row.group(0)
        # measured = the median of the printed steps; error = (predicted - measured) / measured
        b = [_bounds(t) for t in steps]
        assert _agrees(meas, (statistics.median(x for x, _ in b), statistics.median(y for _, y in b))), row.group(0)
        assert _agrees(err, _error_bounds(pred, meas)), row.group(0)
        rows[label] = (pred, meas, err, before)
        # the simulated pipeline against the stage costs printed with --actions: every rank does m x
        # (F + I + W) of its stages, one microbatch passes every F and I and then stage 0's W; with
        # one stage nothing else happens (one rank's F B F B ..., no messages): exactly m x (F + I + W)
        part = out.split(f"[{label}] per action", 1)[1].split("\n\n", 1)[0]
        stages = re.findall(rf"^\s+stage (\d) \(rank (\d)\): predicted F ({NUM}), I ({NUM}), W ({NUM}), B {NUM};",
                            part, re.M)
        assert [int(s) for s, *_ in stages] == list(range(2 if label.startswith("pp=2") else 1)), part
        lo = {(int(s), k): _bounds(v)[0] for s, _r, *fiw in stages for k, v in zip("FIW", fiw)}
        hi = {(int(s), k): _bounds(v)[1] for s, _r, *fiw in stages for k, v in zip("FIW", fiw)}
        ranks = {int(r) for _s, r, *_ in stages}
        work = {r: sum(lo[int(s), k] for s, rr, *_ in stages if int(rr) == r for k in "FIW") for r in ranks}
        path = sum(lo[int(s), k] for s, *_ in stages for k in "FI") + lo[0, "W"]
        assert _bounds(makespan)[1] >= max(m * max(work.values()), path), (label, makespan, stages)
        if len(stages) == 1:
            assert _bounds(makespan)[0] <= m * sum(hi[0, k] for k in "FIW"), (label, makespan, stages)
    preds = [float(rows[k][0]) for k in plans]
    meas = [float(rows[k][1]) for k in plans]
    befores = [float(rows[k][3]) for k in plans]
    rho = re.search(rf"^Spearman rank correlation ({NUM}) \(target >= 0.8: (PASS|FAIL)\)$", out, re.M)
    assert rho, out
    if len(set(preds)) == len(set(meas)) == len(plans):  # no ties made by the rounding: the ranks are the printed ones
        assert abs(float(rho.group(1)) - _spearman(preds, meas)) <= 5e-4 + 1e-9, (rho.group(0), preds, meas)
    if float(rho.group(1)) != 0.8:
        assert rho.group(2) == ("PASS" if float(rho.group(1)) > 0.8 else "FAIL"), rho.group(0)
    before = re.search(rf"^\(with the unit timings taken before the run only: Spearman ({NUM}|nan), median absolute "
                       rf"error ({NUM})%", out, re.M)
    assert before, out
    if len(set(befores)) == len(set(meas)) == len(plans):
        assert abs(float(before.group(1)) - _spearman(befores, meas)) <= 5e-4 + 1e-9, (before.group(0), befores, meas)
    med = re.search(rf"^median absolute error ({NUM})% \(target <= 25%: (PASS|FAIL)\); largest ({NUM})%$", out, re.M)
    assert med, out
    errors = [rows[k][2] for k in plans]
    assert _agrees(med.group(1), _abs_median_bounds(errors)), (med.group(0), errors)
    assert _agrees(med.group(3), _abs_median_bounds(errors, pick=max)), (med.group(0), errors)
    if float(med.group(1)) != 25.0:
        assert med.group(2) == ("PASS" if float(med.group(1)) < 25 else "FAIL"), med.group(0)
    verdict = re.search(r"^P4 cost model: (PASS|FAIL)$", out, re.M)
    assert verdict and verdict.group(1) == ("PASS" if rho.group(2) == med.group(2) == "PASS" else "FAIL"), out
