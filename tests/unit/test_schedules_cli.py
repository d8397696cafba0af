"""`autopar schedule` CLI (acceptance S4, S5)."""
import json
import os
import subprocess
import sys

import pytest

from autopar.schedules import Schedule, build
from autopar.schedules.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run(capsys, *argv):
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_zbv_grid_is_readable_in_80_columns(capsys):
    rc, out, err = run(capsys, "zbv", "--pp", "4", "--microbatches", "8")
    assert rc == 0 and err == ""
    lines = out.splitlines()
    assert max(len(x) for x in lines) <= 80
    assert lines[0] == "zbv: pp=4 stages=8 microbatches=8"
    assert lines[1] == "makespan 25.5   bubble 5.9%"  # 3m + (p-1)/2 at unit per-rank costs
    assert lines[2] == "peak activation memory per rank (M_B): 4 4 4 4"
    # rank 0 starts with 2p-1 = 7 chunk-0 forwards, then its first chunk-1 forward/backward.
    r0 = next(x for x in lines if x.startswith("r0 "))
    assert r0.split()[1:11] == ["F0", "F1", "F2", "F3", "F4", "F5", "F6", "f0", "i0", "w0"]
    r3 = next(x for x in lines if x.startswith("r3 "))
    assert r3.split()[1:5] == [".", ".", ".", "F0"]  # the last rank waits 3 slots for microbatch 0
    # every rank row of every wrapped block is present
    assert sum(1 for x in lines if x.startswith("r")) % 4 == 0


def test_scheduled_passes_all_appear_in_grid(capsys):
    rc, out, _ = run(capsys, "1f1b", "--pp", "2", "--microbatches", "3", "--costs", "1,1,1")
    assert rc == 0
    cells = " ".join(x for x in out.splitlines() if x.startswith("r"))
    for k in range(3):
        assert f"F{k}" in cells and f"B{k}" in cells
    assert "bubble 25.0%" in out  # (p-1)/(m+p-1) = 1/4


def test_json_is_exactly_the_schedule_json(capsys):
    rc, out, err = run(capsys, "zbv", "--pp", "4", "--microbatches", "8", "--json")
    assert rc == 0 and err == ""
    data = json.loads(out)
    assert set(data) == {"schedule", "pp", "stages", "microbatches", "stage_to_rank", "actions"}
    assert Schedule.from_json(data) == build("zbv", 4, 8)
    assert out.strip() == build("zbv", 4, 8).to_json()


def test_trace_file_is_valid_trace_event_json(capsys, tmp_path):
    path = tmp_path / "zbv.trace.json"
    rc, out, _ = run(capsys, "zbv", "--pp", "4", "--microbatches", "8", "--costs", "1,1.5,0.5",
                     "--trace", str(path))
    assert rc == 0 and f"trace written to {path}" in out
    trace = json.loads(path.read_text())
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(events) == 3 * 8 * 8  # F, I, W for 8 microbatches on 8 stages
    for e in events:
        assert set(e) >= {"name", "ph", "ts", "dur", "pid", "tid"}
        assert e["dur"] > 0 and e["ts"] >= 0 and 0 <= e["tid"] < 4
    names = {e["name"] for e in events}
    assert "0F0" in names and "7W7" in names
    meta = [e for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"]
    assert [e["args"]["name"] for e in meta] == ["rank 0", "rank 1", "rank 2", "rank 3"]
    # durations follow the costs: per-stage F = 0.5, I = 0.75, W = 0.25 (ms -> us)
    durs = {e["name"][1]: e["dur"] for e in events if e["name"].startswith("0")}
    assert durs == {"F": 500.0, "I": 750.0, "W": 250.0}


def test_list(capsys):
    rc, out, _ = run(capsys, "--list")
    assert rc == 0
    rows = {x.split()[0]: x for x in out.splitlines()[2:]}
    assert list(rows) == ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zb-auto", "zbv", "v-half",
                          "v-min", "dualpipev"]
    assert "m >= 2*pp" in rows["zbv"] and "m >= pp" in rows["1f1b"]


@pytest.mark.parametrize("argv,msg", [
    (["1f1b", "--pp", "4", "--microbatches", "2"],
     "1f1b needs num_microbatches >= pp: got m=2 < pp=4; use at least 4 microbatches"),
    (["bogus", "--pp", "4", "--microbatches", "8"], "unknown schedule 'bogus'; known: gpipe, 1f1b,"),
    (["zb-auto", "--pp", "4", "--microbatches", "8", "--memory-limit", "0.5"],
     "memory limit 0.5 M_B is below the 1 M_B one microbatch needs on rank 0"),
    (["zbv", "--pp", "4", "--microbatches", "6"], "zbv needs num_microbatches >= 2*pp"),
    (["1f1b", "--pp", "4", "--microbatches", "8", "--memory-limit", "2"], "1f1b needs 4 M_B per rank at peak"),
    (["1f1b", "--pp", "4", "--microbatches", "8", "--costs", "1,x,1"], "--costs expects numbers"),
    (["1f1b", "--pp", "four", "--microbatches", "8"], "argument --pp: invalid int value"),
    (["1f1b", "--pp", "4"], "1f1b needs --pp and --microbatches"),
    ([], "missing schedule NAME"),
])
def test_invalid_requests_print_one_line_and_exit_2(capsys, argv, msg):
    rc, out, err = run(capsys, *argv)
    assert rc == 2
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("autopar schedule: error: ")
    assert msg in err


def test_module_entry_point_and_no_torch_import(tmp_path):
    code = ("import sys, runpy; sys.argv = ['x', 'zb-h1', '--pp', '2', '--microbatches', '2', '--json'];"
            "import autopar.schedules.cli as c; rc = c.main(sys.argv[1:]);"
            "assert 'torch' not in sys.modules, 'schedules imported torch'; print('RC', rc)")
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip().endswith("RC 0")
    res = subprocess.run([sys.executable, "-m", "autopar.schedules.cli", "1f1b", "--pp", "4", "--microbatches", "2"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert res.returncode == 2
    assert res.stderr.strip() == ("autopar schedule: error: 1f1b needs num_microbatches >= pp: got m=2 < pp=4; "
                                  "use at least 4 microbatches")
