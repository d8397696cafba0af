"""The command line a user runs: `autopar demo` (2 gloo processes), `autopar inspect`, dump."""
import os
import subprocess
import sys

import pytest

import autopar
from autopar.cli import main


def test_inspect_writes_readable_programs(tmp_path, capsys):
    out = tmp_path / "dump"
    assert main(["inspect", "--schedule", "zb-h1", "--microbatches", "2", "--layers", "2", "--d-model", "32",
                 "--out", str(out)]) == 0
    files = sorted(os.listdir(out))
    for s in range(2):
        for kind in "FIWB":
            assert f"stage{s}_{kind}.py" in files and f"stage{s}_{kind}.exec.py" in files
    assert {"rank0_step.py", "rank1_step.py", "stages.txt"} <= set(files)
    for name in files:
        if name.endswith(".py"):
            compile((out / name).read_text(), name, "exec")  # readable, valid Python
    w = (out / "stage1_W.py").read_text()
    assert "aten.mm" in w and "gparam:" in w
    assert "_op_aten_mm_default(" in (out / "stage1_W.exec.py").read_text()  # ops bound as globals
    step0 = (out / "rank0_step.py").read_text()
    assert "rt.forward(0, 0)" in step0 and "rt.send_f(0, 0)" in step0
    assert "stage rank" in capsys.readouterr().out


def test_bad_plan_on_the_command_line_exits_2(capsys):
    assert main(["inspect", "--schedule", "no-such-schedule"]) == 2
    assert "unknown schedule" in capsys.readouterr().err


@pytest.mark.slow
def test_demo_on_two_processes_matches_eager():
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "autopar.cli", "demo", "--steps", "2"], capture_output=True,
                          text=True, timeout=170, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "launching 2 gloo processes" in proc.stdout
    assert "losses match single-process eager PyTorch" in proc.stdout


def test_step_with_other_shapes_is_a_clear_error():
    import torch

    from tests.models import make_gpt

    case = make_gpt()
    pm = autopar.parallelize(case.model, case.inputs, loss_fn=case.loss_fn, plan=autopar.Plan(pp=2, num_microbatches=4),
                             example_target=case.target)
    with pytest.raises(ValueError, match="shapes are static"):
        pm.step((case.inputs[0][:4],), case.target[:4])
    with pytest.raises(ValueError, match="shapes are static"):
        pm.step(case.inputs, torch.zeros(8, 31, dtype=torch.long))
