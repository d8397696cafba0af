"""H5: parallelize without a plan considers cp for an HF Llama and ep for an HF Mixtral: the
planner step of autopar/build.py (choose_plan, for a world of 4) prices layouts with cp > 1
(the context-parallel pass accepts Llama's masks) and with ep > 1 (Mixtral's experts are
recognized), and names them in its log."""
import logging

import pytest

from autopar.build import choose_plan
from tests.hf_models import make_hf


@pytest.mark.parametrize("name, axis", [("llama", "cp"), ("mixtral", "ep")])
def test_planner_considers_the_axis(name, axis, caplog):
    case = make_hf(name, batch=8, seq=16)
    with caplog.at_level(logging.INFO, logger="autopar"):
        plan, _summary = choose_plan(model=case.model, inputs=case.inputs, target=case.target, loss_fn=case.loss_fn,
                                     batch=8, world=4)
    wanted = "layouts with cp=2 ep=1" if axis == "cp" else "layouts with cp=1 ep=2"
    lines = [r.getMessage() for r in caplog.records if wanted in r.getMessage()]
    assert lines, [r.getMessage() for r in caplog.records][-10:]
    assert plan.world_size == 4
