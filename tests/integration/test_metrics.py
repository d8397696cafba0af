"""C9 and logging: ``pm.metrics`` after a step, checked against a timer around ``step`` and
against the planner's FLOP count; the log line of ``log_every``; profiler labels per action."""
import logging
import time

import torch

import autopar
from tests.models import make_gpt


def test_metrics_agree_with_a_timer_and_the_planner(caplog):
    from autopar.planner.profile import profile_model

    case = make_gpt()
    prof = profile_model(make_gpt().model, case.inputs, case.target, case.loss_fn)
    pm = autopar.parallelize(case.model, case.inputs, loss_fn=case.loss_fn,
                             optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1),
                             plan=autopar.Plan(pp=2, schedule="1f1b", num_microbatches=4), example_target=case.target,
                             max_grad_norm=1e9, log_every=2)
    step_errors, rate_errors = [], []
    with caplog.at_level(logging.INFO, logger="autopar"):
        for _ in range(6):
            t0 = time.perf_counter()
            loss = pm.step(case.inputs, case.target)
            elapsed = time.perf_counter() - t0
            m = pm.metrics
            tokens = case.inputs[0].numel()
            step_errors.append(abs(m["step_time_s"] - elapsed) / elapsed)
            rate_errors.append(abs(m["tokens_per_s"] - tokens / elapsed) / (tokens / elapsed))
            assert m["loss"] == float(loss) and m["grad_norm"] > 0 and m["peak_memory_bytes"] > 0
    # within 5% of the timer: the median step (a busy 2-core machine can preempt this process
    # for milliseconds between the step's end and the timer's, inside one 50 ms step)
    step_errors.sort()
    rate_errors.sort()
    assert step_errors[3] <= 0.05 and rate_errors[3] <= 0.05, (step_errors, rate_errors)
    # the step's FLOPs are the planner's: F+I+W of every program for the global batch
    planner_flops = prof.flops_per_sample() * case.inputs[0].shape[0]
    assert abs(m["flops"] - planner_flops) <= 1e-3 * planner_flops, (m["flops"], planner_flops)
    assert 0 < m["mfu"] < 1
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step ")]
    assert [ln.split(",")[0] for ln in lines] == ["step 2", "step 4", "step 6"], lines
    assert "tokens/s" in lines[0] and "grad norm" in lines[0]


def test_profiler_labels_each_action():
    case = make_gpt()
    pm = autopar.parallelize(case.model, case.inputs, loss_fn=case.loss_fn,
                             plan=autopar.Plan(pp=2, schedule="zb-h1", num_microbatches=2), example_target=case.target)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        pm.step(case.inputs, case.target)
    names = {e.name for e in prof.events()}
    assert {"0F0", "1F1", "1I0", "1W1", "0W0"} <= names, sorted(n for n in names if n[:1].isdigit())
