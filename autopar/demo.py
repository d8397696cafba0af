"""`autopar demo` and `autopar inspect` on examples/gpt (local mode: every rank in this process)."""
from __future__ import annotations

import copy
import functools
import logging
import time


def _build(args):
    import torch

    import autopar
    from autopar.examples.gpt import make_gpt

    n_head = 4 if args.d_model % 4 == 0 else 1
    model, inputs, target, loss_fn = make_gpt(n_layer=args.layers, d_model=args.d_model, n_head=n_head,
                                              seq_len=args.seq, batch_size=args.batch, seed=0)
    plan = autopar.Plan(pp=args.pp, schedule=args.schedule, num_microbatches=args.microbatches,
                        stages_per_rank=args.stages_per_rank)
    eager_model = copy.deepcopy(model)
    opt = functools.partial(torch.optim.AdamW, lr=getattr(args, "lr", 1e-3))
    pm = autopar.parallelize(model, inputs, loss_fn=loss_fn, optimizer=opt, plan=plan, example_target=target)
    return pm, eager_model, inputs, target, loss_fn, opt


def _eager_losses(model, inputs, target, loss_fn, opt_factory, n_micro: int, steps: int) -> list[float]:
    """Single-process eager training with the same microbatches (design.md §5), for comparison."""
    opt = opt_factory(model.parameters())
    xs, ys = inputs[0].chunk(n_micro), target.chunk(n_micro)
    out = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for x, y in zip(xs, ys):
            loss = loss_fn(model(x), y) / n_micro
            loss.backward()
            total += loss.item()
        opt.step()
        out.append(total)
    return out


def run_demo(args) -> int:
    import torch

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    # Tiny ops: one thread each is fastest, and two threads on a busy 2-core machine spin-wait.
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    pm, eager_model, inputs, target, loss_fn, opt = _build(args)
    b = pm._built
    print(f"\nplan (local mode: all {pm.plan.pp} ranks run in this process; "
          f"microbatches of {b.microbatch_size} samples):\n{pm.plan.table()}\n")
    print(pm.stage_table())
    print(f"\nbuilt in {time.perf_counter() - t0:.1f}s; training {args.steps} steps\n")
    ours = []
    tokens = inputs[0].numel()
    print(f"{'step':>4}  {'autopar loss':>13}  {'eager loss':>11}  {'rel diff':>9}  {'tokens/s':>9}")
    eager = _eager_losses(eager_model, inputs, target, loss_fn, opt, b.num_microbatches, args.steps)
    for step in range(args.steps):
        t = time.perf_counter()
        loss = float(pm.step(inputs, target))
        dt = time.perf_counter() - t
        ours.append(loss)
        rel = abs(loss - eager[step]) / max(abs(eager[step]), 1e-30)
        print(f"{step:>4}  {loss:>13.6f}  {eager[step]:>11.6f}  {rel:>9.2e}  {tokens / dt:>9.0f}")
    worst = max(abs(a - e) / max(abs(e), 1e-30) for a, e in zip(ours, eager))
    ok = worst <= 1e-5
    print(f"\nlosses {'match' if ok else 'DO NOT match'} eager PyTorch (worst relative difference {worst:.2e}, "
          f"tolerance 1e-5)")
    return 0 if ok else 1


def run_inspect(args) -> int:
    pm, *_ = _build(args)
    paths = pm.dump(args.out)
    print(pm.stage_table())
    print(f"\nwrote {len(paths)} files to {args.out}/ (stageN_F.py, stageN_I.py, stageN_W.py, stageN_B.py, stages.txt)")
    return 0
