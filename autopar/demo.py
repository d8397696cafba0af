"""`autopar demo` and `autopar inspect` on examples/gpt.

The demo lets the planner choose the plan for ``--nproc`` CPU processes (gloo, started by
torch's elastic launcher; local mode with ``--nproc 1``), unless plan flags (``--pp``, ``--dp``,
``--schedule``, ``--microbatches``, ``--stages-per-rank``) fix it; builds the GPT on the meta
device (each process materializes only its own stages, initialized as ``autopar.init_weights``
does; ``--no-meta`` builds it whole first); trains, with bf16 mixed precision under ``--bf16``;
then trains the same model in one eager process with the same microbatches (and, with
``--bf16``, the same precision policy) and says whether every loss matches.
"""
from __future__ import annotations

import copy
import functools
import logging
import os
import time
import uuid

SEED = 0


def _model(args, meta: bool = False):
    """(model, inputs, target, loss_fn): the GPT on the meta device when ``meta``, else built
    and initialized as ``autopar.init_weights`` would (the same values either way)."""
    import torch

    import autopar
    from autopar.examples.gpt import GPT, GPTConfig, make_gpt

    n_head = 4 if args.d_model % 4 == 0 else 1
    _, inputs, target, loss_fn = make_gpt(n_layer=args.layers, d_model=args.d_model, n_head=n_head,
                                          seq_len=args.seq, batch_size=args.batch, seed=0)
    with torch.device("meta"):
        model = GPT(GPTConfig(seq_len=args.seq, n_layer=args.layers, n_head=n_head, d_model=args.d_model))
    if not meta:
        autopar.init_weights(model, seed=SEED)
    return model, inputs, target, _fp32_loss if getattr(args, "bf16", False) else loss_fn


def _fp32_loss(logits, target):
    """Cross entropy on fp32 logits (what mixed precision wants of a loss)."""
    import torch.nn.functional as F

    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), target.reshape(-1))


def _plan(args, auto: bool = True):
    """The plan the flags fix, or None (the planner decides) when no plan flag is given."""
    import autopar

    tp = getattr(args, "tp", None)
    flags = (args.pp, args.dp, tp, args.schedule, args.microbatches, args.stages_per_rank)
    if auto and all(f is None for f in flags):
        return None
    dp, tp = args.dp or 1, tp or 1
    pp = args.pp or (max(1, args.nproc // (dp * tp)) if getattr(args, "nproc", 1) > 1 else 2)
    return autopar.Plan(pp=pp, dp=dp, tp=tp, schedule=args.schedule or "1f1b", num_microbatches=args.microbatches,
                        stages_per_rank=args.stages_per_rank)


def _optimizer(args):
    import torch

    return functools.partial(torch.optim.AdamW, lr=getattr(args, "lr", 1e-3))


def _build(args, auto: bool = True):
    import torch

    import autopar

    model, inputs, target, loss_fn = _model(args, meta=getattr(args, "meta", False))
    precision = autopar.MixedPrecision(param_dtype=torch.bfloat16) if getattr(args, "bf16", False) else None
    pm = autopar.parallelize(model, inputs, loss_fn=loss_fn, optimizer=_optimizer(args), plan=_plan(args, auto),
                             example_target=target, seed=SEED, mixed_precision=precision,
                             compile=True if getattr(args, "compile", False) else None)
    return pm, inputs, target, loss_fn


def _eager_losses(model, inputs, target, loss_fn, opt_factory, n_micro: int, steps: int,
                  compute_dtype=None) -> list[float]:
    """Single-process eager training with the same microbatches (design.md §5), for comparison.
    With ``compute_dtype`` a copy in that dtype runs forward and backward, gradients accumulate
    in fp32, the optimizer steps the fp32 model and the copy is refreshed (mixed precision)."""
    import torch

    compute = copy.deepcopy(model).to(compute_dtype) if compute_dtype is not None else model
    opt = opt_factory(model.parameters())
    xs, ys = inputs[0].chunk(n_micro), target.chunk(n_micro)
    out = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        grads = [torch.zeros_like(p) for p in model.parameters()]
        total = 0.0
        for x, y in zip(xs, ys):
            loss = loss_fn(compute(x), y) / n_micro
            for g, d in zip(grads, torch.autograd.grad(loss, list(compute.parameters()), allow_unused=True)):
                if d is not None:
                    g.add_(d)
            total += loss.item()
        for p, g in zip(model.parameters(), grads):
            p.grad = g
        opt.step()
        if compute is not model:
            with torch.no_grad():
                for c, p in zip(compute.parameters(), model.parameters()):
                    c.copy_(p)
        out.append(total)
    return out


def _train(args) -> dict:
    """Build and train; in a launched worker this runs on every rank."""
    import torch

    torch.set_num_threads(1)  # tiny ops: one thread is fastest, two spin-wait on a busy 2-core box
    t0 = time.perf_counter()
    pm, inputs, target, _loss_fn = _build(args)
    built = time.perf_counter() - t0
    losses, times = [], []
    for _ in range(args.steps):
        t = time.perf_counter()
        losses.append(float(pm.step(inputs, target)))
        times.append(time.perf_counter() - t)
    b = pm.built
    from autopar.inspect import resident_parameter_bytes, stage_rows

    rows = stage_rows(b.programs, b.schedule)
    resident = resident_parameter_bytes(pm)
    for row in rows:
        row["resident_bytes"] = resident
    return {"losses": losses, "times": times, "built_s": built, "plan": pm.plan.table(), "dp": pm.plan.dp,
            "planned": getattr(pm, "planner_summary", None),
            "stage_rows": rows, "microbatches": b.num_microbatches,
            "mb_size": b.microbatch_size, "tokens": inputs[0].numel()}


def _worker(args) -> dict:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    try:
        return _train(args)
    finally:
        dist.destroy_process_group()


def run_demo(args) -> int:
    import torch

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    plan = _plan(args)
    if args.nproc > 1:
        if plan is not None and plan.world_size != args.nproc:
            raise ValueError(f"--nproc {args.nproc} but the plan needs pp*dp*tp = {plan.pp}*{plan.dp}*{plan.tp} = "
                             f"{plan.world_size} processes; make them agree")
        from torch.distributed.launcher.api import LaunchConfig, elastic_launch

        print(f"autopar demo: launching {args.nproc} gloo processes (torch elastic launcher)")
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=args.nproc,
                              run_id=f"autopar-{uuid.uuid4().hex[:8]}",
                              rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0, monitor_interval=0.5,
                              start_method="spawn")
        results = elastic_launch(config, _worker)(args)
        res = dict(results[0])
        # each process traced its own stages: the table is the union of their rows
        seen = {}
        for r in sorted(results):
            for row in results[r]["stage_rows"]:
                seen.setdefault(row["stage"], row)
        res["stage_rows"] = list(seen.values())
        mode = f"{args.nproc} processes"
    else:
        res = _train(args)
        mode = "local mode: every rank in this process"
    how = "chosen by the planner" if plan is None else "fixed by the flags"
    print(f"\nplan ({how}; {mode}; microbatches of {res['mb_size']} samples):\n{res['plan']}")
    if res.get("planned"):
        print(f"  {res['planned']}")
    print()
    from autopar.inspect import stage_table

    print(stage_table([], rows=res["stage_rows"]))
    print(f"\nbuilt in {res['built_s']:.1f}s; trained {args.steps} steps\n")
    import torch

    model, inputs, target, loss_fn = _model(args)
    bf16 = getattr(args, "bf16", False)
    eager = _eager_losses(model, inputs, target, loss_fn, _optimizer(args), res["microbatches"] * res["dp"], args.steps,
                          compute_dtype=torch.bfloat16 if bf16 else None)
    print(f"{'step':>4}  {'autopar loss':>13}  {'eager loss':>11}  {'rel diff':>9}  {'tokens/s':>9}")
    for step, (loss, dt, ref) in enumerate(zip(res["losses"], res["times"], eager)):
        rel = abs(loss - ref) / max(abs(ref), 1e-30)
        print(f"{step:>4}  {loss:>13.6f}  {ref:>11.6f}  {rel:>9.2e}  {res['tokens'] / dt:>9.0f}")
    worst = max(abs(a - e) / max(abs(e), 1e-30) for a, e in zip(res["losses"], eager))
    tol = 1e-3 if bf16 else 1e-5  # design.md section 5: bf16 rounding differs by op order
    ok = worst <= tol
    what = "eager PyTorch under the same bf16 policy" if bf16 else "eager PyTorch"
    print(f"\nlosses {'match' if ok else 'DO NOT match'} single-process {what} (worst relative difference "
          f"{worst:.2e}, tolerance {tol:g}); {time.perf_counter() - t0:.0f}s in all")
    return 0 if ok else 1


def run_inspect(args) -> int:
    args.nproc = 1
    pm, *_ = _build(args, auto=False)  # inspect shows pipeline stages: pp=2 unless the flags say otherwise
    paths = pm.dump(args.out)
    print(pm.stage_table())
    print(f"\nwrote {len(paths)} files to {args.out}/ (stageN_F.py, stageN_I.py, stageN_W.py, stageN_B.py: stage "
          "programs; rankN_step.py: what each pipeline rank runs per step; stages.txt)")
    return 0
