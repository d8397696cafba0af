"""A real training run's pieces over gloo, each against eager PyTorch (issue 14):

C4  lr schedulers (CosineAnnealingLR, LambdaLR) on ``pm.optimizer`` and parameter groups (no
    weight decay on norms and biases) under ZeRO 0, 1, 2, 3;
C5  ``max_grad_norm``: the reported norm and the clipped update equal ``clip_grad_norm_``
    (pp=2 with the tied embedding/head, pp=2 x dp=2 ZeRO-3, ep=2);
C6  ``batch="local"``: each process passes its replica's slice (pp=2 x dp=2), and the middle
    pipeline ranks of pp=4 pass None;
C7  ``pm.evaluate`` equals eager no-grad and leaves parameters and optimizer state unchanged.

One process group per world size runs every sub-case of that size (sub-case errors are
collected, not raised, so every sub-case reports).
"""
import functools

import pytest
import torch

from tests.dist.harness import run_shared

pytestmark = pytest.mark.slow


def no_decay(fqn, p):
    """AdamW options: no weight decay on norms and biases."""
    return {"weight_decay": 0.0} if p.ndim < 2 else {}


def _adamw():
    return functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.1, eps=1e-4)


SCHEDULERS = {
    "cosine": lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=4, eta_min=1e-3),
    "lambda": lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step)),
}

# (label, case, plan, options): options "sched", "clip", "local", "none_middle", "eval"
MATRIX = {
    2: [("zero0 cosine groups", "gpt", dict(dp=2, num_microbatches=2), {"sched": "cosine", "groups": True}),
        ("zero1 lambda groups", "gpt", dict(dp=2, num_microbatches=2, zero=1), {"sched": "lambda", "groups": True}),
        ("zero2 cosine groups", "gpt", dict(dp=2, num_microbatches=2, zero=2), {"sched": "cosine", "groups": True}),
        ("zero3 lambda groups", "gpt", dict(dp=2, num_microbatches=2, zero=3), {"sched": "lambda", "groups": True}),
        ("pp2 clip tied", "gpt", dict(pp=2, schedule="1f1b", num_microbatches=2), {"clip": 0.05}),
        ("ep2 clip", "moe_ep", dict(dp=2, ep=2, num_microbatches=2), {"clip": 0.05}),
        ("pp2 zbv eval", "gpt", dict(pp=2, schedule="zbv", num_microbatches=4), {"eval": True})],
    4: [("pp2xdp2 zero3 clip", "gpt", dict(pp=2, dp=2, num_microbatches=2, zero=3), {"clip": 0.05}),
        ("pp2xdp2 local", "gpt", dict(pp=2, dp=2, num_microbatches=2), {"local": True}),
        ("pp4 local None", "skip", dict(pp=4, num_microbatches=4), {"local": True, "none_middle": True}),
        ("pp2xdp2 eval", "gpt", dict(pp=2, dp=2, num_microbatches=2, zero=1), {"eval": True})],
}


def _run(rank, world, subcases):
    import traceback

    import autopar
    from tests.models import ALL_CASES

    out = []
    for _label, case_name, plan, opts in subcases:
        try:
            case = ALL_CASES[case_name](seed=5)
            kw = {}
            if opts.get("groups"):
                kw["param_groups"] = no_decay
            if "clip" in opts:
                kw["max_grad_norm"] = opts["clip"]
            if opts.get("local"):
                kw["batch"] = "local"
            inputs, target = case.inputs, case.target
            if opts.get("local"):  # this replica's contiguous slice of the global batch (dp rank = rank // pp)
                dp, r = plan.get("dp", 1), rank // plan.get("pp", 1)
                n = target.shape[0] // dp
                inputs, target = tuple(x[r * n:(r + 1) * n] for x in inputs), target[r * n:(r + 1) * n]
            pm = autopar.parallelize(case.model, inputs, loss_fn=case.loss_fn, optimizer=_adamw(),
                                     plan=autopar.Plan(**plan), example_target=target, timeout=60, **kw)
            assert not opts.get("local") or pm.data_parallel_rank == rank // plan.get("pp", 1)
            sched = SCHEDULERS[opts["sched"]](pm.optimizer) if "sched" in opts else None
            if opts.get("none_middle") and pm.built.mesh.pp_rank in (1, 2):
                inputs, target = (None,), None
            res = {"losses": [], "norms": [], "lrs": []}
            for _ in range(4 if sched else 2):
                res["losses"].append(pm.step(inputs, target))
                res["norms"].append(pm.metrics["grad_norm"])
                res["lrs"].append(pm.optimizer.param_groups[0]["lr"])
                if sched is not None:
                    sched.step()
            if opts.get("eval"):
                before = pm.state_dict()
                opt_before = {k: v.clone() if isinstance(v, torch.Tensor) else v
                              for st in pm.optimizer.state_dict()["state"].values() for k, v in st.items()}
                res["eval"] = pm.evaluate(inputs, target)
                after = pm.state_dict()
                opt_after = {k: v for st in pm.optimizer.state_dict()["state"].values() for k, v in st.items()}
                res["unchanged"] = all(torch.equal(before[k], after[k]) for k in before) and all(
                    torch.equal(v, opt_after[k]) if isinstance(v, torch.Tensor) else v == opt_after[k]
                    for k, v in opt_before.items())
            res["state"] = pm.state_dict()
            out.append(res)
        except Exception:  # noqa: BLE001 - report per sub-case
            out.append({"traceback": traceback.format_exc()})
    return out


def _eval_reference(case, state, dp: int, m: int):
    """Eager no-grad loss of the batch, cut into the same dp x m microbatches (design.md §5)."""
    from tests.reference import split_batch

    case.model.load_state_dict(state)
    xs = [x for rep in split_batch(case.inputs[0], dp, m) for x in rep]
    ys = [y for rep in split_batch(case.target, dp, m) for y in rep]
    with torch.no_grad():
        return sum(case.loss_fn(case.model(x), y) / (dp * m) for x, y in zip(xs, ys))


@pytest.mark.parametrize("world", sorted(MATRIX))
def test_training_pieces_match_eager(world):
    from tests.models import ALL_CASES
    from tests.reference import assert_close_state, eager_reference

    subcases = MATRIX[world]
    per_rank = run_shared(_run, world, subcases, deadline_s=600, reuse=False)
    failures = []
    for i, (label, case_name, plan, opts) in enumerate(subcases):
        try:
            case = ALL_CASES[case_name](seed=5)
            norms = []
            ref_losses, ref_state = eager_reference(
                case.model, case.inputs, case.target, case.loss_fn, _adamw(), dp=plan.get("dp", 1),
                num_microbatches=plan["num_microbatches"], steps=4 if "sched" in opts else 2,
                param_groups=no_decay if opts.get("groups") else None,
                scheduler=SCHEDULERS.get(opts.get("sched")), max_grad_norm=opts.get("clip"), norms=norms)
            for r in range(world):
                res = per_rank[r][i]
                assert "traceback" not in res, f"rank {r}:\n{res.get('traceback')}"
                for got, want in zip(res["losses"], ref_losses):
                    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
                assert_close_state(res["state"], ref_state)
                if "clip" in opts:  # C5: the norm each step, before clipping, equals clip_grad_norm_'s
                    assert norms and min(float(n) for n in norms) > opts["clip"], "the clip never bites"
                    for got, want in zip(res["norms"], norms):
                        torch.testing.assert_close(torch.tensor(got), want.float(), rtol=1e-5, atol=0)
                if "sched" in opts:  # C4: the schedule changed the lr the update used
                    assert len(set(res["lrs"])) == len(res["lrs"]), res["lrs"]
                if opts.get("eval"):  # C7
                    want = _eval_reference(ALL_CASES[case_name](seed=5), ref_state, plan.get("dp", 1),
                                           plan["num_microbatches"])
                    torch.testing.assert_close(res["eval"], want, rtol=1e-5, atol=0)
                    assert res["unchanged"], "evaluate changed a parameter or the optimizer state"
        except AssertionError as e:
            failures.append(f"{label}: {e}")
    assert not failures, "\n\n".join(failures)
