"""Smoke tests of benchmarks/pp_vs_torch.py (R4), schedule_speedup.py (R5) and zero_vs_fsdp2.py
(X3) at tiny sizes.

Each script's ``main`` runs in this process, its 2 ranks on the session's shared pool of gloo
processes (``run_pooled``), and must return 0. Speed
targets are never judged here (at these sizes overheads dominate, and a shared CI box is
noisy); what is checked can fail for a real reason: R4's first-step losses of autopar and of
torch.distributed.pipelining both equal the eager loss computed here; every median, ratio and
disagreement printed is the one the printed step times and predictions give (to their
rounding); a verdict matches its number; and R5's predicted makespans lie within bounds
derived from first principles from the stage costs it printed; X3's first-step losses of
autopar ZeRO-3 and of FSDP2 both equal the eager loss computed here.
"""
import re
import statistics

import pytest
import torch

from tests.dist.harness import run_pooled as _run

# one xdist worker runs every benchmark smoke test with ranks, so they share one pool of gloo processes
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("benchmarks")]

NUM = r"\d+\.\d+"



def _bounds(text: str) -> tuple[float, float]:
    """The interval a printed number was rounded from (half a unit of its last digit around it)."""
    half = 0.5 * 10.0 ** -len(text.split(".")[1]) if "." in text else 0.5
    return float(text) - half, float(text) + half


def _div(a, b):
    return a[0] / b[1], a[1] / b[0]


def _median_bounds(texts) -> tuple[float, float]:
    """A median is increasing in every argument: the medians of the lower and of the upper ends."""
    b = [_bounds(t) for t in texts]
    return statistics.median(x for x, _ in b), statistics.median(y for _, y in b)


def _median_ratio_bounds(num, den) -> tuple[float, float]:
    """Bounds of the median of the per-round ratios num[k] / den[k]."""
    r = [_div(_bounds(a), _bounds(b)) for a, b in zip(num, den)]
    return statistics.median(x for x, _ in r), statistics.median(y for _, y in r)


def _agrees(printed: str, lo_hi) -> bool:
    """The printed value could be the rounding of a value in [lo, hi]."""
    plo, phi = _bounds(printed)
    return plo <= lo_hi[1] * (1 + 1e-12) and lo_hi[0] * (1 - 1e-12) <= phi


def _verdict_ok(value: str, target: float, verdict: str) -> bool:
    return float(value) == target or verdict == ("MET" if float(value) < target else "NOT MET")


def test_pp_vs_torch_runs():
    mk = dict(n_layer=4, d_model=32, n_head=2, seq_len=16, batch_size=8, vocab_size=256, seed=0)
    out = _run("pp_vs_torch.py", ["--layers", "4", "--d-model", "32", "--heads", "2", "--seq", "16", "--batch", "8",
                                  "-m", "4", "--steps", "2", "--warmup", "0", "--deadline", "75"])
    # the oracle: the same seeded model and batch, one eager forward (the mean token loss of the
    # batch, which the mean of the 4 equal microbatches' means is)
    from autopar.examples.gpt import make_gpt

    model, (idx,), target, loss_fn = make_gpt(**mk)
    with torch.no_grad():
        eager = float(loss_fn(model(idx), target))
    assert "MISMATCH" not in out, out
    for kind, target_ratio in (("1f1b", 1.00), ("zbv", 0.90)):
        blocks = re.search(rf"^\[{kind}\] blocks per stage: autopar (\[.*?\]\]), torch", out, re.M)
        assert blocks, out
        stages = [[int(b) for b in re.findall(r"\d+", s)] for s in re.findall(r"\[[\d, ]*\]", blocks.group(1))]
        assert len(stages) == (2 if kind == "1f1b" else 4), out
        # autopar's stages hold every block, in order (a block cut inside appears in two stages)
        flat = [b for s in stages for b in s]
        assert sorted(set(flat)) == list(range(mk["n_layer"])) and flat == sorted(flat), stages

        loss = re.search(rf"^\[{kind}\] first-step loss: autopar ({NUM}), torch ({NUM}), rel diff (\S+) \(OK, tol",
                         out, re.M)
        assert loss, out
        la, lt, rel = float(loss.group(1)), float(loss.group(2)), float(loss.group(3))
        assert abs(la - eager) <= 2e-5 * abs(eager), (kind, la, eager)
        assert abs(lt - eager) <= 2e-5 * abs(eager), (kind, lt, eager)
        assert rel <= 1e-4 and abs(rel - abs(la - lt) / abs(lt)) <= 2e-6 / abs(lt) + 0.01 * rel, (kind, la, lt, rel)

        med = re.search(rf"^\[{kind}\] median step: autopar ({NUM}) ms, torch ({NUM}) ms \(autopar steps ([\d, ]+); "
                        rf"torch ([\d, ]+)\)$", out, re.M)
        assert med, out
        steps_a, steps_t = med.group(3).split(", "), med.group(4).split(", ")
        assert len(steps_a) == len(steps_t) == 2, out
        assert _agrees(med.group(1), _median_bounds(steps_a)), med.group(0)
        assert _agrees(med.group(2), _median_bounds(steps_t)), med.group(0)

        rat = re.search(rf"^\[{kind}\] ratio of medians ({NUM}), median of per-round ratios ({NUM})$", out, re.M)
        assert rat, out
        assert _agrees(rat.group(1), _div(_bounds(med.group(1)), _bounds(med.group(2)))), (rat.group(0), med.group(0))
        assert _agrees(rat.group(2), _median_ratio_bounds(steps_a, steps_t)), (rat.group(0), med.group(0))

        judged = re.search(rf"^RATIO {kind} autopar/torch = ({NUM}) \(target <= {target_ratio:.2f}: (MET|NOT MET)\)$",
                           out, re.M)
        assert judged, out
        assert judged.group(1) == rat.group(2), (judged.group(0), rat.group(0))
        assert _verdict_ok(judged.group(1), target_ratio, judged.group(2)), judged.group(0)


def _costs(out: str, label: str) -> dict[str, list[str]]:
    m = re.search(rf"^stage costs, {re.escape(label)} \(ms\): F (\S+)  I (\S+)  W (\S+)(?:  B (\S+))?$", out, re.M)
    assert m, out
    return {k: v.split("/") for k, v in zip("FIWB", m.groups()) if v is not None}


def _makespan_bounds(name: str, c: dict, m: int) -> tuple[float, float]:
    """Bounds on a zero-latency makespan from per-stage costs (ms, as printed), m microbatches:

    * at least each rank's work: m x (F + B) per 1f1b stage, m x (F + I + W) for zb-h1 / zbv;
    * at least: rank 1 starts after stage 0's first F, and (1f1b) its last B is followed by
      stage 0's B of that microbatch; for zbv, one microbatch's path F0 F1 F2 F3 I3 I2 I1 I0 W0;
    * at most all the work of both ranks (with no latency, while the step runs some rank always
      computes: if both waited, each on the other, the schedule would never finish)."""
    lo = {k: [_bounds(x)[0] for x in v] for k, v in c.items()}
    hi = {k: [_bounds(x)[1] for x in v] for k, v in c.items()}
    if name == "1f1b":
        work = lambda t, s: t["F"][s] + t["B"][s]  # noqa: E731
        lower = max(m * work(lo, 0), lo["F"][0] + m * work(lo, 1) + lo["B"][0])
        return lower, m * (work(hi, 0) + work(hi, 1))
    work = lambda t, s: t["F"][s] + t["I"][s] + t["W"][s]  # noqa: E731
    if name == "zb-h1":
        return max(m * work(lo, 0), lo["F"][0] + m * work(lo, 1)), m * (work(hi, 0) + work(hi, 1))
    rank0, rank1 = (0, 3), (1, 2)  # zbv: the V placement
    lower = max(m * sum(work(lo, s) for s in rank0), lo["F"][0] + m * sum(work(lo, s) for s in rank1),
                sum(lo["F"]) + sum(lo["I"]) + lo["W"][0])
    return lower, m * sum(work(hi, s) for s in range(4))


def test_schedule_speedup_runs():
    m = 4
    out = _run("schedule_speedup.py", ["--layers", "2", "--d-model", "32", "--heads", "2", "--seq", "16",
                                       "--batch", "8", "-m", str(m), "--steps", "2", "--warmup", "0",
                                       "--cost-steps", "1", "--pings", "3", "--deadline", "75"])
    two, four = _costs(out, "2 stages (1f1b, zb-h1)"), _costs(out, "4 stages (zbv)")
    assert all(len(v) == 2 for v in two.values()) and set(two) == set("FIWB"), two
    assert all(len(v) == 4 for v in four.values()) and set(four) == set("FIW"), four
    pred, pred0, meas, steps = {}, {}, {}, {}
    for name in ("1f1b", "zb-h1", "zbv"):
        row = re.search(rf"^\[{name}\] predicted makespan ({NUM}) ms \(({NUM}) without P2P\), {NUM} from in-rank "
                        rf"costs; measured median step ({NUM}) ms \(steps ([\d, ]+)\)$", out, re.M)
        assert row, out
        pred[name], pred0[name], meas[name] = row.group(1), row.group(2), row.group(3)
        steps[name] = row.group(4).split(", ")
        assert len(steps[name]) == 2, row.group(0)
        # the simulator's makespan without P2P, for the costs printed, within first-principles bounds
        lower, upper = _makespan_bounds(name, two if name != "zbv" else four, m)
        assert lower <= _bounds(pred0[name])[1] and _bounds(pred0[name])[0] <= upper, (name, lower, pred0[name], upper)
        # a latency on every message cannot make a fixed-order schedule finish earlier
        assert _bounds(pred[name])[1] >= _bounds(pred0[name])[0], row.group(0)
        assert _agrees(meas[name], _median_bounds(steps[name])), row.group(0)
    for name in ("zb-h1", "zbv"):
        line = re.search(rf"^\[{name}/1f1b\] ratio of medians ({NUM}), median of per-round ratios ({NUM}); "
                         rf"predicted ({NUM}) \(({NUM}) without P2P\)$", out, re.M)
        assert line, out
        q_med, q, p, p0 = line.groups()
        assert _agrees(q_med, _div(_bounds(meas[name]), _bounds(meas["1f1b"]))), line.group(0)
        assert _agrees(q, _median_ratio_bounds(steps[name], steps["1f1b"])), line.group(0)
        assert _agrees(p, _div(_bounds(pred[name]), _bounds(pred["1f1b"]))), line.group(0)
        assert _agrees(p0, _div(_bounds(pred0[name]), _bounds(pred0["1f1b"]))), line.group(0)
        for tag in (" ", r"\(in-rank costs\) "):
            judged = re.search(rf"^RATIO{tag}{name}/1f1b predicted ({NUM}) measured ({NUM}) disagreement ({NUM})% "
                               rf"\(target <= 15%: (MET|NOT MET)\)$", out, re.M)
            assert judged, out
            jp, jq, dis, verdict = judged.groups()
            assert jq == q and (tag != " " or jp == p), (judged.group(0), line.group(0))
            (plo, phi), (qlo, qhi) = _bounds(jp), _bounds(jq)
            d = [abs(x - y) / y * 100 for x in (qlo, qhi) for y in (plo, phi)]
            # |q - p| / p over the box (it is 0 inside when the boxes overlap)
            lo_d = 0.0 if qlo <= phi and plo <= qhi else min(d)
            assert _agrees(dis, (lo_d, max(d))), judged.group(0)
            assert _verdict_ok(dis, 15.0, verdict), judged.group(0)


def test_zero_vs_fsdp2_runs():
    rounds, steps = 2, 1
    mk = dict(n_layer=2, d_model=32, n_head=2, seq_len=16, batch_size=4, vocab_size=256, seed=0)
    out = _run("zero_vs_fsdp2.py", ["--layers", "2", "--d-model", "32", "--heads", "2", "--seq", "16", "--batch", "4",
                                    "--vocab", "256", "--rounds", str(rounds), "--steps", str(steps)])
    from autopar.examples.gpt import make_gpt

    model, (idx,), target, loss_fn = make_gpt(**mk)
    n_params = sum(p.numel() for p in model.parameters())  # the tied embedding / head once
    with torch.no_grad():
        eager = float(loss_fn(model(idx), target))
    # the oracle: both first-step losses are the eager loss of the global batch (autopar: one
    # microbatch per replica, averaged over dp; fsdp2: the ranks' half-batch losses averaged)
    first = re.search(rf"^first-step loss: autopar ({NUM})  fsdp2 ({NUM})$", out, re.M)
    assert first, out
    for name, loss in zip(("autopar", "fsdp2"), first.groups()):
        assert abs(float(loss) - eager) <= 2e-5 * abs(eager), (name, loss, eager)
    rows = dict((k, v) for k, *v in re.findall(rf"^(autopar|fsdp2)\s+({NUM})\s+({NUM})\s+({NUM})$", out, re.M))
    assert set(rows) == {"autopar", "fsdp2"}, out
    # each rank keeps its half of the fp32 parameters and of both AdamW states, at most a little more
    # (autopar keeps the resident group whole; padding; AdamW's step counters): 6 to 6.6 bytes per parameter
    for name, (_ms, state, _peak) in rows.items():
        assert 6 * n_params / 1024 <= float(state) <= 6.6 * n_params / 1024, (name, state, n_params)
    x3 = re.search(rf"^X3: autopar / fsdp2 step time = ({NUM}) \(target <= 1.0\): (PASS|FAIL); peak memory autopar / "
                   rf"fsdp2 = ({NUM}); autopar issued (\d+) parameter all-gathers per rank in all$", out, re.M)
    assert x3, out
    ratio, verdict, peak_ratio, gathers = x3.groups()
    assert _agrees(ratio, _div(_bounds(rows["autopar"][0]), _bounds(rows["fsdp2"][0]))), (x3.group(0), rows)
    assert _agrees(peak_ratio, _div(_bounds(rows["autopar"][2]), _bounds(rows["fsdp2"][2]))), (x3.group(0), rows)
    assert float(ratio) == 1.0 or verdict == ("PASS" if float(ratio) < 1.0 else "FAIL"), x3.group(0)
    # the same all-gathers every step (first, warm-up, timed, probed), at least one per layer group
    n_steps = 2 + rounds * steps + 1
    assert int(gathers) % n_steps == 0 and int(gathers) // n_steps >= mk["n_layer"], (gathers, n_steps)


def test_ep_dispatch_runs():
    """E4 at a tiny size: the three dispatches agree exactly, and the printed byte ratio is the
    one the printed per-rank bytes give; the worst case moves 2 * ep * P rows of d floats (+ weights and ids)
    per direction, a hand count."""
    tokens, d, experts, k = 32, 8, 4, 2
    out = _run("ep_dispatch.py", ["--tokens", str(tokens), "--d-model", str(d), "--hidden", "16", "--experts",
                                  str(experts), "--top-k", str(k), "--rounds", "2", "--steps", "1", "--no-target"])
    agree = re.search(r"^outputs and gradients agree to (\S+) \(relative; target <= 1e-05\): PASS$", out, re.M)
    assert agree and float(agree.group(1)) <= 1e-5, out
    rows = {name: [float(v) for v in kib.split(", ")]
            for name, kib in re.findall(rf"^(autopar|worst-case|reference)\s+{NUM}\s+(\S+, \S+)$", out, re.M)}
    assert set(rows) == {"autopar", "worst-case", "reference"}, out
    pair = tokens * min(k, experts // 2)
    worst = (2 * 2 * pair * (d + 1) * 4 + 2 * pair * 8 + 2 * 2 * pair * d * 4) / 1024  # rows+weights, ids, combine
    assert rows["worst-case"] == [pytest.approx(worst, abs=0.06)] * 2, (rows, worst)
    ratio = re.search(rf"^bytes autopar / worst-case = ({NUM})", out, re.M)
    # (the printed KiB are rounded to 0.05 KiB: the ratio they give, within that)
    assert ratio and abs(float(ratio.group(1)) - sum(rows["autopar"]) / sum(rows["worst-case"])) <= 0.01, out
    assert re.search(rf"^E4: autopar / reference step time = {NUM} \(target <= 1.1\): (PASS|FAIL)$", out, re.M), out


def test_memory_does_not_grow_with_microbatches():
    """A1 at a small size (pp=2, 1f1b and zbv, m = 4 and 16 at a fixed microbatch): each rank's
    peak at m=16 within 5% of its peak at m=4, where holding every send until the end of the
    step would add 12 boundary tensors per boundary (each the microbatch's [2, 32, 32] fp32
    activations, 8 KiB: about 10% of this rank's peak); the sends held at once are the same
    at both m; the boundary tensor's printed size is that hand count."""
    out = _run("memory_vs_microbatches.py", ["--layers", "2", "--d-model", "32", "--heads", "2", "--seq", "32",
                                             "--vocab", "64", "-m", "4,16", "--base", "4",
                                             "--schedules", "1f1b,zbv"], deadline_s=300.0)
    rows = re.findall(rf"^\s+([01])\s+({NUM})\s+({NUM})\s+({NUM})\s+(\d+)/(\d+)\s+({NUM})\s+(PASS|FAIL)$", out, re.M)
    assert len(rows) == 4, out
    for rank, p4, p16, ratio, held4, held16, boundary, verdict in rows:
        assert float(p16) <= 1.05 * float(p4) + 0.01 and verdict == "PASS", out
        assert held4 == held16, out
        # 12 more sends held to the end of the step would have cost more than the 5% allowed
        assert 12 * 2 * 32 * 32 * 4 / 2**20 > 0.05 * float(p4), out
    assert any(float(b) == pytest.approx(2 * 32 * 32 * 4 / 2**20, abs=1e-3) for *_x, b, _v in rows), out
    assert re.search(r"^A1: PASS$", out, re.M), out


def test_muon_benchmark_counts_what_zero1_moves():
    """U5 at a tiny size: every collective of a ZeRO-1 step at dp=2 is the gradients'
    reduce-scatter (the whole flat vector, fp32) and the parameters' all-gather (the same), plus
    one fp32 scalar per gradient-norm all-reduce: bytes = 8 x flat elements + 4 k, k small;
    the ratio printed is the worse rank's ratio of the printed bytes."""
    out = _run("muon.py", ["--layers", "3", "--d-model", "32", "--heads", "2", "--seq", "16", "--batch", "4",
                           "--steps", "2"])
    rows = re.findall(r"^(AdamW|Muon)\s+(\d)\s+(" + NUM + r")\s+([\d,]+)\s+([\d,]+)\s+([\d,]+)$", out, re.M)
    assert len(rows) == 4, out
    got = {}
    for label, rank, _ms, sent, elements, padding in rows:
        sent, elements = int(sent.replace(",", "")), int(elements.replace(",", ""))
        assert 0 <= sent - 8 * elements <= 64 and (sent - 8 * elements) % 4 == 0, (label, sent, elements)
        got[label, rank] = sent
    ratio = float(re.search(r"bytes per step (" + NUM + r")x", out).group(1))
    assert ratio == pytest.approx(max(got["Muon", r] / got["AdamW", r] for r in "01"), abs=5e-4)
    assert ("PASS" in out) == (ratio <= 1.25)


def test_packing_benchmark_counts_real_tokens():
    """V3 at a tiny size: the padded batches' real tokens are each piece's length - 1 (its first
    token predicts nothing), counted here from the document stream; packed steps hold more; the
    ratio printed is the worse rank's ratio of the printed rates."""
    import itertools

    from benchmarks.packing import documents

    seq, rows, steps = 64, 4, 3
    out = _run("packing.py", ["--layers", "1", "--d-model", "32", "--heads", "2", "--seq", str(seq),
                              "--batch", str(rows), "--steps", str(steps)])
    got = {(m.group(1), m.group(2)): (float(m.group(4)), float(m.group(6))) for m in re.finditer(
        r"^(packed|padded)\s+(\d)\s+(" + NUM + r")\s+(" + NUM + r")\s+(" + NUM + r")\s+(" + NUM + r")$", out, re.M)}
    assert len(got) == 4, out
    pieces = itertools.islice((p for d in documents(seq) for p in d.split(seq)), rows * steps)
    per_step = [0] * steps
    for i, p in enumerate(pieces):
        per_step[i // rows] += p.numel() - 1
    assert got["padded", "0"][0] == pytest.approx(statistics.mean(per_step[1:]), abs=0.051)
    assert got["packed", "0"][0] > got["padded", "0"][0]
    ratio = float(re.search(r"per second (" + NUM + r")x", out).group(1))
    want = min(got["packed", r][1] / got["padded", r][1] for r in "01")
    assert ratio == pytest.approx(want, rel=0.01)
    assert ("PASS" in out) == (ratio > 1.5)
