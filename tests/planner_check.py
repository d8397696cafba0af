"""The planner's per-rank parameter bytes for a runtime plan, to compare with what the runtime
allocates (the planner and the runtime share one ZeRO layout, passes/zero_layout.py)."""
from __future__ import annotations


def planner_parameter_bytes(model, inputs: tuple, target, loss_fn, plan: dict) -> tuple[dict, list[float]]:
    """(the plan with the planner's stage cuts, per pp rank the parameter bytes the planner
    predicts: its weights row, i.e. whole weights or under ZeRO-3 the master shards and resident
    group, plus the ZeRO-3 gather buffers), for one stage per pipeline rank cut at the balanced
    units."""
    from autopar.planner.devices import get_profile
    from autopar.planner.estimate import Evaluator, Layout, Partition
    from autopar.planner.profile import profile_model

    prof = profile_model(model, inputs, target, loss_fn)
    pp, dp, m = plan.get("pp", 1), plan.get("dp", 1), plan["num_microbatches"]
    units = len(prof.units)
    bounds = tuple(round(s * units / pp) for s in range(pp + 1))
    lay = Layout(pp=pp, dp=dp, cp=1, ep=1, schedule=plan["schedule"], v=1, m=m,
                 b=inputs[0].shape[0] // (dp * m), zero=plan.get("zero", 0))
    ev = Evaluator(prof, get_profile("h100"), 1e12, inputs[0].shape[0])
    est = ev.evaluate(lay, Partition(bounds, (False,) * pp))
    cuts = tuple(prof.units[b].cut for b in bounds[1:-1])
    return dict(plan, stage_cuts=cuts), [row["weights"] + row["zero-3 gather"] for row in est.memory]
