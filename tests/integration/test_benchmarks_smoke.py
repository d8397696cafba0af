"""Smoke test of benchmarks/split_backward.py (A5) and benchmarks/capture.py (A6) at tiny sizes.

Each script's ``main(argv)`` runs in this process (no second torch import): it must return 0
and print its result lines. Timings are not checked here; only that the scripts work.
"""
import importlib.util
import os
import re

import pytest

BENCH_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks")
NUM = r"\d+\.\d+"


def _load(name: str):
    path = os.path.join(BENCH_DIR, f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"autopar_benchmark_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_split_backward_benchmark_runs(capsys):
    bench = _load("split_backward")
    rc = bench.main(["--layers", "1", "--d-model", "32", "--heads", "2", "--seq", "8", "--batch", "2",
                     "--reps", "2", "--warmup", "1"])
    out = capsys.readouterr().out
    assert rc == 0, out
    # the three implementations agreed before anything was timed
    assert len(re.findall(r"^check .* allclose\(rtol=1e-05\): OK;", out, flags=re.M)) >= 3, out
    assert "MISMATCH" not in out
    assert re.search(rf"^ours\(F\+I\+W\)/eager\(fwd\+bwd\) = {NUM}  \(target <= 1\.05\)  (MET|NOT MET)", out, re.M), out
    assert re.search(rf"^ours\(F\+I\+W\)/torch\(F\+I\+W\) = {NUM}  \(target <= 0\.95\)  (MET|NOT MET)", out, re.M), out
    assert re.search(rf"^ours\(F\+B\)/eager\(fwd\+bwd\) = {NUM}", out, re.M), out


def test_capture_benchmark_runs(capsys):
    bench = _load("capture")
    rc = bench.main(["--layers", "2", "--d-model", "64", "--heads", "4", "--seq", "16", "--batch", "2",
                     "--vocab", "128", "--stages", "2"])
    out = capsys.readouterr().out
    assert rc == 0, out
    for phase in ("capture", "split_stages", "split_backward"):
        assert re.search(rf"^{phase} = {NUM} s", out, re.M), out
    assert re.search(rf"^total\(capture\+split_stages\+split_backward\) = {NUM} s  \(target < 60 s\)", out, re.M), out


@pytest.mark.parametrize("name", ["split_backward", "capture"])
def test_benchmark_help_has_flags(name, capsys):
    bench = _load(name)
    with pytest.raises(SystemExit) as exc:
        bench.main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--layers", "--d-model"):
        assert flag in out
