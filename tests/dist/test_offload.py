"""Issue 35 M3: activation offload (runtime/offload.py) on 2 gloo processes.

For 1f1b, zb-h1 and zbv at pp=2 (the planner's stage cuts), examples/gpt (4 blocks of width 64,
128 tokens a sample, so that activations outweigh the small fixed tensors) trained two SGD
steps with ``Plan(offload=0)`` matches eager PyTorch (loss 1e-5, parameters 1e-4), and with
``Plan(offload=1)`` gives bit-for-bit the same losses and parameters as without; so do zb-h1 and
zbv with a different share per stage (``PER_STAGE``) and the copy back one action ahead. A run
whose copy back hands out its buffer before the bytes arrive (what a reload racing its copy
does) is caught: its losses differ. On every rank, the device-resident activation bytes of
step 2 drop by the planner's predicted drop of its activations, within 5%: measured as the
bytes of the distinct storages behind every microbatch's saved values and kept stage inputs
(not parameters, and an input only once its F ran: before, it is a transfer buffer), sampled
when F ends, when a backward program has what it reads back and after every action
(``activation_peak``), the quantity the planner's "activations" row predicts; the whole peak
of live tensor bytes (``PeakTensorMemory``, the host pool left out) drops; and the host pool's
peak is the planner's parked bytes (``Estimate.host_bytes``) within 5%.
"""
import functools

import pytest
import torch

from tests.dist.harness import run_shared

pytestmark = pytest.mark.slow

SCHEDULES = ("1f1b", "zb-h1", "zbv")
M, BATCH = 4, 8
# per-stage shares (what the planner chooses where memory binds: Evaluator.least_offload)
PER_STAGE = {"zb-h1": (0.5, 0.0), "zbv": (0.5, 1.0, 0.0, 0.25)}


def _model():
    from autopar.examples.gpt import make_gpt

    return make_gpt(n_layer=4, d_model=64, n_head=4, seq_len=128, batch_size=BATCH, vocab_size=256, seed=0)


def _plans():
    """{schedule: (the plan at the planner's cuts, {offload: per-rank predicted activation bytes})}."""
    from autopar.planner.devices import get_profile
    from autopar.planner.estimate import Evaluator, Layout
    from autopar.planner.profile import profile_model
    from autopar.planner.search import price, to_plan
    from autopar.schedules import default_stages_per_rank

    model, inputs, target, loss_fn = _model()
    mb = BATCH // M
    prof = profile_model(model, tuple(x[:mb] for x in inputs), target[:mb], loss_fn, name="gpt")
    ev = Evaluator(prof, get_profile("h100"), 1e15, BATCH)
    out = {}
    for sched in SCHEDULES:
        lay = Layout(2, 1, 1, 1, sched, default_stages_per_rank(sched), M, mb, 0)
        cand = price(ev, lay)
        ests = {f: ev.evaluate(Layout(2, 1, 1, 1, sched, lay.v, M, mb, 0, f), cand.estimate.partition)
                for f in (0.0, 1.0)}
        acts = {f: [row["activations"] for row in est.memory] for f, est in ests.items()}
        acts["host"] = list(ests[1.0].host_bytes)
        out[sched] = (to_plan(ev, cand), acts)
    return out


def activation_peak(work, step):
    """Run ``step()`` and return the peak of the saved bytes of ``work``'s microbatch envs (module
    docstring), sampled at the ends of F, after the offload brought values back, after every action."""
    from autopar.passes import keys
    from autopar.runtime.memory_probe import storage_bytes

    peak = [0]
    state = {t.untyped_storage()._cdata for t in work.state.values() if isinstance(t, torch.Tensor)}
    ran_f = set()  # (stage, microbatch) whose F ran: an input waiting for its F is a P2P/hand-off buffer

    def sample():  # (saved views of the parameters are the parameters: not activations)
        vals = [v for sk, env in work.envs.items() for k, v in env.items()
                if keys.is_kind(k, keys.SAVED) or (keys.is_kind(k, keys.INPUT) and sk in ran_f)]
        flat = [t for v in vals for t in (v if isinstance(v, (tuple, list)) else (v,))
                if isinstance(t, torch.Tensor) and t.untyped_storage()._cdata not in state]
        peak[0] = max(peak[0], storage_bytes(flat))

    def around(obj, name, before=False):
        orig = getattr(obj, name)

        def wrapped(*a, **k):
            if before:
                sample()
            out = orig(*a, **k)
            sample()
            return out
        setattr(obj, name, wrapped)

    for name in ("forward", "input_grads", "weight_grads", "full_backward"):
        around(work, name)
    forward = work.forward

    def forward_noted(s, k, *a, **kw):
        ran_f.add((s, k))
        return forward(s, k, *a, **kw)
    work.forward = forward_noted
    if work.offload is not None:
        around(work.offload, "after_forward", before=True)
        around(work.offload, "before")
    step()
    return peak[0]


def _train(rank, world, subcases):
    import autopar
    from autopar.runtime import offload as offload_mod
    from autopar.runtime.memory_probe import PeakTensorMemory

    out = []
    for plan, racing, ahead in subcases:
        model, inputs, target, loss_fn = _model()
        saved = offload_mod.ActivationOffload._copy_back
        if racing:  # the buffer is handed out before the bytes arrive
            def early(self, box):
                dst = torch.empty(box.buffer.numel(), dtype=torch.uint8, device=self.device)
                self.pool.give(box.buffer)
                return dst.untyped_storage()
            offload_mod.ActivationOffload._copy_back = early
        try:
            pm = autopar.parallelize(model, inputs, loss_fn=loss_fn, plan=plan,
                                     optimizer=functools.partial(torch.optim.SGD, lr=0.5), example_target=target)
            work = pm.built.executor.work
            if ahead and work.offload is not None:  # the copy back one action ahead (off by default on CPU)
                work.offload.prefetch_ahead = True
            losses = [pm.step(inputs, target)]
            params = [p for p in work.grads.tensors.values()]
            skip = work.offload.pool.owns if work.offload is not None else None
            with PeakTensorMemory(params, skip=skip) as probe:
                acts = activation_peak(work, lambda: losses.append(pm.step(inputs, target)))
        finally:
            offload_mod.ActivationOffload._copy_back = saved
        out.append({"losses": losses, "state": pm.state_dict(), "peak": probe.peak_bytes, "acts": acts,
                    "host": work.offload.pool.peak_bytes if work.offload is not None else 0,
                    "offloaded": pm.metrics.get("offloaded_bytes"), "table": pm.stage_table(),
                    "by_stage": dict(work.offload.stage_bytes) if work.offload is not None else {}})
    return out


def test_offload_is_bitwise_and_drops_what_the_planner_predicts():
    import dataclasses

    from tests.reference import assert_close_state, eager_reference

    plans = _plans()
    subcases = []
    for sched in SCHEDULES:
        plan, _ = plans[sched]
        subcases += [(plan, False, False), (dataclasses.replace(plan, offload=1.0), False, False)]
    subcases.append((dataclasses.replace(plans["1f1b"][0], offload=1.0), True, False))
    subcases += [(dataclasses.replace(plans[sched][0], offload=PER_STAGE[sched]), False, True) for sched in PER_STAGE]
    per_rank = run_shared(_train, 2, subcases, deadline_s=300)
    model, inputs, target, loss_fn = _model()
    want_losses, want_state = eager_reference(model, inputs, target, loss_fn,
                                              functools.partial(torch.optim.SGD, lr=0.5), num_microbatches=M, steps=2)
    for j, sched in enumerate(SCHEDULES):
        _plan, acts = plans[sched]
        for r in range(2):
            off, on = per_rank[r][2 * j], per_rank[r][2 * j + 1]
            if r == 1:  # the runs without offload are eager PyTorch's (the last stage returns the loss)
                for got, want in zip(off["losses"], want_losses):
                    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
            assert_close_state(off["state"], want_state, rtol=1e-4)
            for a, b in zip(off["losses"], on["losses"]):
                assert torch.equal(a, b), (sched, r, off["losses"], on["losses"])
            for k in off["state"]:
                assert torch.equal(off["state"][k], on["state"][k]), (sched, r, k)
            assert on["offloaded"] > 0, (sched, r)
            predicted = acts[0.0][r] - acts[1.0][r]
            measured = off["acts"] - on["acts"]
            assert abs(measured - predicted) <= 0.05 * predicted, (sched, r, measured, predicted, off["acts"], on["acts"],
                                                                  acts[0.0][r], acts[1.0][r])
            if predicted:  # and the whole device peak drops
                assert on["peak"] < off["peak"], (sched, r)
            # the host pool's peak is the planner's parked bytes
            assert abs(on["host"] - acts["host"][r]) <= 0.05 * acts["host"][r], (sched, r, on["host"], acts["host"])
    racing = per_rank[0][2 * len(SCHEDULES)]["losses"]
    assert any(not torch.equal(a, b) for a, b in zip(racing, per_rank[0][0]["losses"])), \
        "a copy back that races its copy went unnoticed"
    for j, sched in enumerate(PER_STAGE):  # per-stage shares, brought back one action ahead
        base = per_rank[0][2 * SCHEDULES.index(sched)]
        ahead = per_rank[0][2 * len(SCHEDULES) + 1 + j]
        assert ahead["offloaded"] > 0 and all(torch.equal(a, b) for a, b in zip(ahead["losses"], base["losses"]))
        # the stage table shows what each stage copied out in the step: the stages at share 0 nothing
        ran = {int(line.split()[0]) for line in ahead["table"].splitlines()[2:]}
        assert "offload/step" in ahead["table"] and sum(ahead["by_stage"].values()) == ahead["offloaded"]
        for s in ran:
            assert (ahead["by_stage"].get(s, 0) > 0) == (PER_STAGE[sched][s] > 0), (sched, s, ahead["by_stage"])
        assert all(torch.equal(ahead["state"][k], base["state"][k]) for k in base["state"]), sched
