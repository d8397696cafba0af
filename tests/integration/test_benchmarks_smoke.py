"""Smoke tests of the single-process benchmarks at tiny sizes: benchmarks/split_backward.py (A5),
benchmarks/capture.py (A6), benchmarks/schedules_vs_torch.py (the simulator tables) and
benchmarks/gpu_check.py (R7: its refusal without CUDA; the whole check where CUDA is present).

Each script's ``main(argv)`` runs in this process (no second torch import): it must return 0.
Timings are never judged here (a shared CI box is noisy, and tiny sizes are all overhead);
what is checked can fail for a real reason: the gradients agree with eager PyTorch (the
benchmark's own check, and one computed here), the check catches a wrong gradient, every ratio
printed is the ratio of the medians printed beside it, a verdict matches its number, the
capture's counts match the model, identical schedules simulate to identical makespans and no
makespan beats the single-step lower bound.
"""
import importlib.util
import math
import os
import re

import pytest
import torch

BENCH_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks")
NUM = r"\d+\.\d+"


def _load(name: str):
    path = os.path.join(BENCH_DIR, f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"autopar_benchmark_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _bounds(text: str) -> tuple[float, float]:
    """The interval a printed number was rounded from (half a unit of its last digit around it)."""
    half = 0.5 * 10.0 ** -len(text.split(".")[1]) if "." in text else 0.5
    return float(text) - half, float(text) + half


def _ratio_bounds(a: str, b: str) -> tuple[float, float]:
    (alo, ahi), (blo, bhi) = _bounds(a), _bounds(b)
    return alo / bhi, ahi / blo


def _agrees(printed: str, lo_hi: tuple[float, float]) -> bool:
    """The printed value could be the rounding of a value in [lo, hi]."""
    plo, phi = _bounds(printed)
    return plo <= lo_hi[1] * (1 + 1e-12) and lo_hi[0] * (1 - 1e-12) <= phi


SPLIT_ARGS = ["--layers", "1", "--d-model", "32", "--heads", "2", "--seq", "8", "--batch", "2", "--reps", "2",
              "--warmup", "1"]


def test_split_backward_benchmark_runs(capsys, monkeypatch):
    bench = _load("split_backward")
    seen = {}
    check_same = bench.check_same

    def keep_variants(v):
        seen["v"] = v
        return check_same(v)

    monkeypatch.setattr(bench, "check_same", keep_variants)
    rc = bench.main(SPLIT_ARGS)
    out = capsys.readouterr().out
    assert rc == 0, out

    # the benchmark's check before timing: every other variant vs eager, all OK, and the printed
    # worst difference within what allclose(rtol, atol = rtol * max|ref|) admits (2 rtol)
    checks = re.findall(r"^check\s+(\S+) vs eager\(fwd\+bwd\): input grad \+ \d+ weight grads allclose\(rtol=1e-05\): "
                        r"(OK|MISMATCH[^;]*); max \|diff\|/max\|ref\| (\S+) ", out, flags=re.M)
    others = ["ours(F+I+W)", "ours(F+B)", "torch(F+I+W)", "ours(F+I+W),again"]
    assert sorted(c[0] for c in checks) == sorted(others), out
    assert all(ok == "OK" and float(err) <= 2e-5 for _name, ok, err in checks), checks

    # an independent oracle: ours F+I+W against gradients computed here with torch.autograd.grad
    v = seen["v"]
    xin = v.x.detach().requires_grad_(True)
    ref = torch.autograd.grad(v.blocks(xin), [xin, *v.weights], v.g)
    gin, gw = v.ours_fiw()
    assert torch.allclose(gin, ref[0], rtol=1e-5, atol=1e-5 * ref[0].abs().max().item())
    assert set(gw) == set(v.fqns)
    for fqn, r in zip(v.fqns, ref[1:]):
        assert torch.allclose(gw[fqn], r, rtol=1e-5, atol=1e-5 * r.abs().max().item()), fqn
    # and the benchmark's check can fail: one weight gradient of ours(F+B) off by 0.1%
    first = v.fqns[0]
    monkeypatch.setattr(v, "ours_fb", lambda: (gin, {f: t * 1.001 if f == first else t for f, t in gw.items()}))
    assert not check_same(v)
    assert re.search(rf"^check\s+ours\(F\+B\) vs .*MISMATCH {re.escape(first)}", capsys.readouterr().out, re.M)

    # medians per variant, then every ratio line: the bracketed ratios of the medians are the
    # ratios of the medians printed above (to their rounding); a verdict is the one its number gets
    cpu = dict(re.findall(rf"^\s+(\S+): cpu\s+({NUM}) ms", out, re.M))
    wall = dict(re.findall(rf"^\s+(\S+): cpu\s+{NUM} ms\s+wall\s+({NUM}) ms", out, re.M))
    assert set(cpu) == set(wall) == {"ours(F+I+W)", "ours(F+B)", "eager(fwd+bwd)", "torch(F+I+W)",
                                     "ours(F+I+W),again"}, out
    ratios = re.findall(rf"^(\S+)/(\S+) = ({NUM})(?:  \(target <= ({NUM})\)  (MET|NOT MET))?   "
                        rf"\[({NUM}); wall ({NUM}); min ({NUM})\]$", out, re.M)
    assert [(a, b) for a, b, *_ in ratios] == [("ours(F+I+W)", "eager(fwd+bwd)"), ("ours(F+I+W)", "torch(F+I+W)"),
                                               ("ours(F+B)", "eager(fwd+bwd)"), ("torch(F+I+W)", "eager(fwd+bwd)"),
                                               ("ours(F+I+W),again", "ours(F+I+W)")], out
    for a, b, r, target, verdict, r_cpu, r_wall, r_min in ratios:
        assert math.isfinite(float(r)) and float(r) > 0 and float(r_min) > 0, (a, b)
        assert _agrees(r_cpu, _ratio_bounds(cpu[a], cpu[b])), (a, b, r_cpu, cpu[a], cpu[b])
        assert _agrees(r_wall, _ratio_bounds(wall[a], wall[b])), (a, b, r_wall, wall[a], wall[b])
        if target and float(r) != float(target):
            assert verdict == ("MET" if float(r) < float(target) else "NOT MET"), (a, b, r, target, verdict)
    assert [t for *_, t, _v, _c, _w, _m in ratios[:2]] == ["1.05", "0.95"]  # the two judged targets
    assert all(not t for *_, t, _v, _c, _w, _m in ratios[2:])


def test_capture_benchmark_runs(capsys):
    bench = _load("capture")
    rc = bench.main(["--layers", "2", "--d-model", "64", "--heads", "4", "--seq", "16", "--batch", "2",
                     "--vocab", "128", "--stages", "2"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "FAIL" not in out, out
    # the capture holds every parameter of the model once (the tied embedding / head once) ...
    from autopar.examples.gpt import make_gpt

    model = make_gpt(n_layer=2, d_model=64, n_head=4, seq_len=16, batch_size=2, vocab_size=128, device="meta")[0]
    m = re.search(r"^\s+capture:\s+\S+ s\s+\((\d+) ops, (\d+) parameters,", out, re.M)
    assert m, out
    assert int(m.group(2)) == len(dict(model.named_parameters())), out
    # ... and split_stages puts each of its ops in exactly one of the 2 stages
    per_stage = re.search(r"^\s+split_stages:\s+\S+ s\s+\(ops per stage: ([\d, ]+)\)", out, re.M)
    assert per_stage, out
    counts = [int(x) for x in per_stage.group(1).split(",")]
    assert len(counts) == 2 and all(c > 0 for c in counts) and sum(counts) == int(m.group(1)), out
    # split_backward ran once per stage, inside its phase
    sb = re.search(rf"^\s+split_backward:\s+({NUM}) s\s+\(per stage: ([\d., ]+)\)", out, re.M)
    assert sb, out
    each = sb.group(2).split(", ")
    assert len(each) == 2 and sum(_bounds(t)[0] for t in each) <= _bounds(sb.group(1))[1], out
    # the total judged is the sum of the three phases printed, and its verdict the one it gets
    phases = dict(re.findall(rf"^(capture|split_stages|split_backward) = ({NUM}) s  \(\d+% of total", out, re.M))
    assert set(phases) == {"capture", "split_stages", "split_backward"}, out
    tot = re.search(rf"^total\(capture\+split_stages\+split_backward\) = ({NUM}) s  \(target < 60 s\)  (MET|NOT MET)",
                    out, re.M)
    assert tot, out
    lo = sum(_bounds(t)[0] for t in phases.values())
    hi = sum(_bounds(t)[1] for t in phases.values())
    assert _agrees(tot.group(1), (lo, hi)), (tot.group(1), phases)
    if float(tot.group(1)) != 60.0:
        assert tot.group(2) == ("MET" if float(tot.group(1)) < 60 else "NOT MET")


@pytest.mark.parametrize("name", ["split_backward", "capture"])
def test_benchmark_help_has_flags(name, capsys):
    bench = _load(name)
    with pytest.raises(SystemExit) as exc:
        bench.main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--layers", "--d-model"):
        assert flag in out


def test_schedules_vs_torch_benchmark_runs(capsys):
    bench = _load("schedules_vs_torch")
    pp, effort = 2, 2
    assert bench.main(["--pp", str(pp), "--quick", "--effort", str(effort)]) == 0
    out = capsys.readouterr().out
    profiles = list(bench.PROFILES)
    # Table 1: one row per pair (m = 2p with --quick); the same order of actions must give the same
    # makespan in every profile; the worst ratio is the largest cell
    cells = rf"((?:\s+{NUM}){{{len(profiles)}}})"
    rows = re.findall(rf"^(\S+) vs (\S+)\s+{pp}\s+{2 * pp}{cells}\s+(yes|no)$", out, re.M)
    assert [(a, b) for a, b, _c, _s in rows] == [(ours, cls) for cls, ours, _v in bench.PAIRS], out
    worst = 0.0
    for _a, _b, c, same in rows:
        ratios = [float(x) for x in c.split()]
        assert all(r > 0 for r in ratios), c
        if same == "yes":
            assert ratios == [1.0] * len(profiles), (c, same)
        worst = max(worst, *ratios)
    w = re.search(rf"^worst ratio: ({NUM})$", out, re.M)
    assert w and float(w.group(1)) == worst, (w, worst)
    # Table 2: per profile, the lower bound m (F + I + W) + (p - 1) F / 2 (every rank computes m (F + I + W);
    # the last rank waits for microbatch 0), both libraries' best makespans at or above it, the ratio
    # ours / torch, and the searched column no worse than the default one
    m = 2 * pp
    t2 = re.findall(rf"^\s+{pp}\s+{m} (\S+)\s+({NUM})\s+({NUM}) (\S+)\s+({NUM}) (\S+)\s+({NUM})\s+({NUM})\s+({NUM})$",
                    out, re.M)
    assert [r[0] for r in t2] == profiles, out
    summary = {}
    for key, bound, bt, _lt, bo, _lo, ratio, be, ratio_e in t2:
        f, i, w_ = bench.PROFILES[key]
        assert _agrees(bound, (m * (f + i + w_) + (pp - 1) * f / 2,) * 2), (key, bound)
        assert _bounds(bt)[1] >= _bounds(bound)[0] and _bounds(bo)[1] >= _bounds(bound)[0], (key, bound, bt, bo)
        assert _agrees(ratio, _ratio_bounds(bo, bt)) and _agrees(ratio_e, _ratio_bounds(be, bt)), (key, ratio, ratio_e)
        assert float(be) <= float(bo), (key, be, bo)
        summary[key] = (ratio, ratio_e)
    for key, (ratio, ratio_e) in summary.items():  # one row per profile: its min and max are that row's
        line = re.search(rf"^profile {re.escape(key)}\s+ours/torch: default min ({NUM}) max ({NUM}); effort={effort} "
                         rf"min ({NUM}) max ({NUM})$", out, re.M)
        assert line and line.groups() == (ratio, ratio, ratio_e, ratio_e), (key, line, ratio, ratio_e)


def test_gpu_check_runs(capsys, tmp_path):
    bench = _load("gpu_check")
    if not torch.cuda.is_available():  # the CPU path: refuses with exit code 2, saying why
        assert bench.main([]) == 2
        assert "no CUDA device here" in capsys.readouterr().err
        return
    rc = bench.main(["--layers", "2", "--d-model", "64", "--heads", "2", "--seq", "32", "--batch", "8",
                     "--trace", str(tmp_path / "trace.json")])
    out = capsys.readouterr().out
    assert rc == 0, out
    checks = re.findall(r"^numerics local_transfers=(True|False): .* (OK|MISMATCH) \(rtol", out, re.M)
    assert checks == [("False", "OK"), ("True", "OK")], out
    assert re.search(r"^RESULT numerics OK, streams OK$", out, re.M), out
