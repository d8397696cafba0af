"""Train a GPT with autopar, the way a real run goes.

    torchrun --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint localhost:0 examples/train.py \\
        --pp 2 --steps 200 --save-every 50 --out runs/gpt
    # after an interruption, the same command with --resume continues from the last checkpoint
    # (under another plan too: --pp 1 --dp 2 reads the same checkpoint)

What it does: builds the model on the meta device (each process materializes only its own
stages, initialized as ``autopar.init_weights`` would, or from ``--weights``), feeds each data
parallel replica its own slice of a synthetic token stream through a ``DataLoader`` with a
``DistributedSampler`` (``batch="local"``), trains with AdamW (no weight decay on norms and
biases), a linear warmup then cosine schedule, gradient clipping, a held-out evaluation every
``--eval-every`` steps, a checkpoint every ``--save-every`` steps (``pm.save``; resumed with
``--resume``), and one metrics line every ``--log-every`` steps on rank 0. Without torchrun it
runs in one process (local mode: every pipeline rank in turn). ``--packed``: documents of
varying length packed into the rows (``autopar.data``), see ``main_packed``.
"""
from __future__ import annotations

import argparse
import itertools
import math
import os

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, DistributedSampler

import autopar
import autopar.data
from autopar.examples.gpt import GPT, GPTConfig, gpt_loss


class Tokens(Dataset):
    """A deterministic synthetic corpus: sequences of a repeating pattern plus noise, so the
    loss goes down; item i is (tokens[i, :-1], tokens[i, 1:])."""

    def __init__(self, n: int, seq: int, vocab: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        base = torch.arange(seq + 1) % 17
        noise = torch.randint(0, vocab, (n, seq + 1), generator=g)
        keep = torch.rand(n, seq + 1, generator=g) < 0.7
        self.data = torch.where(keep, (base + torch.arange(n)[:, None]) % vocab, noise)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i):
        return self.data[i, :-1], self.data[i, 1:]


def documents(seq: int, vocab: int, seed: int):
    """An endless deterministic stream of documents of log-normal lengths (median seq / 4, some
    longer than a row), each a repeating pattern from its own start plus noise, so the loss goes
    down (``--packed``)."""
    g = torch.Generator().manual_seed(seed)
    while True:
        n = max(2, int(torch.empty(()).log_normal_(math.log(seq / 4), 1.0, generator=g)))
        start = int(torch.randint(0, vocab, (), generator=g))
        tokens = (start + torch.arange(n) % 17) % vocab
        noise = torch.randint(0, vocab, (n,), generator=g)
        yield torch.where(torch.rand(n, generator=g) < 0.8, tokens, noise)


def no_decay(fqn: str, p: torch.nn.Parameter) -> dict:
    """AdamW options per parameter: no weight decay on norms and biases."""
    return {"weight_decay": 0.0} if p.ndim < 2 else {}


def warmup_cosine(warmup: int, total: int):
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    return factor


def setup(args) -> tuple[autopar.Plan, GPT]:
    """The process group (under torchrun), the plan of the flags and the GPT on the meta device."""
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if "RANK" in os.environ and not dist.is_initialized():
        dist.init_process_group("gloo" if not torch.cuda.is_available() else "nccl")
    world = dist.get_world_size() if dist.is_initialized() else 1
    plan = autopar.Plan(pp=args.pp or world // args.dp, dp=args.dp, schedule=args.schedule,
                        num_microbatches=args.microbatches, zero=args.zero)
    cfg = GPTConfig(vocab_size=args.vocab, seq_len=args.seq, n_layer=args.layers, n_head=4, d_model=args.d_model)
    with torch.device("meta"):
        return plan, GPT(cfg)


def save(pm, out: str) -> None:
    """A checkpoint ``out/stepNNNNNN``, then ``out/latest`` pointing at it (the pointer moves
    only to a complete checkpoint)."""
    name = f"step{pm.step_count:06d}"
    pm.save(os.path.join(out, name))
    if not dist.is_initialized() or dist.get_rank() == 0:
        latest = os.path.join(out, "latest")
        with open(latest + ".tmp", "w") as fh:
            fh.write(name)
        os.replace(latest + ".tmp", latest)


def resume(pm, out: str) -> None:
    """Load the checkpoint ``out/latest`` points at, if there is one."""
    latest = os.path.join(out, "latest")
    if os.path.exists(latest):
        with open(latest) as fh:
            pm.load(os.path.join(out, fh.read().strip()))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pp", type=int, default=None, help="pipeline ranks (default: every process)")
    ap.add_argument("--dp", type=int, default=1)
    ap.add_argument("--zero", type=int, default=0)
    ap.add_argument("--schedule", default="1f1b")
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16, help="global batch (samples per step)")
    ap.add_argument("--steps", type=int, default=20, help="length of the run (the lr schedule's end)")
    ap.add_argument("--stop-at", type=int, default=None,
                    help="stop after this step, as a job with a time limit would; --resume continues the run")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--max-grad-norm", type=float, default=1.0)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--save-every", type=int, default=10)
    ap.add_argument("--log-every", type=int, default=5)
    ap.add_argument("--bf16", action="store_true", help="bf16 mixed precision")
    ap.add_argument("--weights", default=None, help="initial weights (safetensors file or HF-style directory)")
    ap.add_argument("--out", default="runs/gpt", help="checkpoint directory")
    ap.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out")
    ap.add_argument("--packed", action="store_true",
                    help="train on documents of varying length packed into the rows (autopar.data), the model's own "
                         "loss over every real token")
    args = ap.parse_args(argv)
    if args.packed:
        return main_packed(args)

    plan, model = setup(args)
    pp, local = plan.pp, args.batch // args.dp
    train, held_out = Tokens(40 * args.batch, args.seq, args.vocab, seed=0), Tokens(args.batch, args.seq, args.vocab, 1)
    # every process runs the sampler of its dp replica (pipeline ranks of one replica get the same data)
    dp_rank = (dist.get_rank() // pp) if dist.is_initialized() else 0
    sampler = DistributedSampler(train, num_replicas=args.dp, rank=dp_rank, shuffle=True, seed=0, drop_last=True)
    loader = DataLoader(train, batch_size=local, sampler=sampler, drop_last=True)
    x0, y0 = next(iter(loader))
    def adamw(groups):
        return torch.optim.AdamW(groups, lr=args.lr, weight_decay=0.1)

    pm = autopar.parallelize(
        model, (x0,), loss_fn=gpt_loss, optimizer=adamw,
        plan=plan, example_target=y0, param_groups=no_decay, max_grad_norm=args.max_grad_norm, batch="local",
        log_every=args.log_every, weights=args.weights,
        mixed_precision=autopar.MixedPrecision(param_dtype=torch.bfloat16) if args.bf16 else None)
    assert pm.data_parallel_rank == dp_rank
    if args.resume:
        resume(pm, args.out)  # parameters, optimizer, step count, RNG
    # the lr schedule continues where the checkpoint stopped (its initial_lr is in param_groups)
    scheduler = torch.optim.lr_scheduler.LambdaLR(pm.optimizer, warmup_cosine(args.warmup, args.steps),
                                                  last_epoch=pm.step_count - 1)
    n = held_out.data.shape[0] // args.dp
    ex, ey = held_out.data[dp_rank * n:(dp_rank + 1) * n, :-1], held_out.data[dp_rank * n:(dp_rank + 1) * n, 1:]
    losses, evals = [], []
    epoch, skip = divmod(pm.step_count, len(loader))  # resumed: where in the data it stopped
    stop = min(args.steps, args.stop_at or args.steps)
    while pm.step_count < stop:
        sampler.set_epoch(epoch)
        for i, (x, y) in enumerate(loader):
            if i < skip:
                continue
            skip = 0
            losses.append(float(pm.step((x,), y)))
            scheduler.step()
            if pm.step_count % args.eval_every == 0:
                evals.append(float(pm.evaluate((ex,), ey)))
            if pm.step_count % args.save_every == 0:
                save(pm, args.out)
            if pm.step_count >= stop:
                break
        epoch += 1
    return {"losses": losses, "evals": evals, "steps": pm.step_count, "lr": pm.optimizer.param_groups[0]["lr"]}


def main_packed(args) -> dict:
    """``--packed``: every step's global batch is ``--batch`` rows of ``--seq`` tokens packed from a
    document stream (``autopar.data.packed_batches``: best-fit decreasing, rows balanced over the
    dp x microbatch slices); the model takes ``input_ids``, ``position_ids`` (each document
    attends to itself only) and ``labels`` and returns its loss, the mean over every real token of
    the global batch (``loss_fn=None``). Every process builds the same stream and passes the
    global batch; resuming skips the batches already trained on."""
    plan, model = setup(args)
    groups = args.dp * args.microbatches
    stream = autopar.data.packed_batches(documents(args.seq, args.vocab, seed=0), args.seq, args.batch, groups=groups)
    held_out = next(autopar.data.packed_batches(documents(args.seq, args.vocab, seed=1), args.seq, args.batch,
                                                groups=groups))
    first = next(stream)
    pm = autopar.parallelize(
        model, first, loss_fn=None, optimizer=lambda g: torch.optim.AdamW(g, lr=args.lr, weight_decay=0.1), plan=plan,
        param_groups=no_decay, max_grad_norm=args.max_grad_norm, log_every=args.log_every, weights=args.weights,
        mixed_precision=autopar.MixedPrecision(param_dtype=torch.bfloat16) if args.bf16 else None)
    if args.resume:
        resume(pm, args.out)
    scheduler = torch.optim.lr_scheduler.LambdaLR(pm.optimizer, warmup_cosine(args.warmup, args.steps),
                                                  last_epoch=pm.step_count - 1)
    batches = itertools.chain([first], stream)  # step k trains on the k-th batch
    for _ in range(pm.step_count):  # resumed: the batches already trained on
        next(batches)
    losses, evals, real = [], [], []
    stop = min(args.steps, args.stop_at or args.steps)
    while pm.step_count < stop:
        batch = next(batches)
        real.append(float((batch["labels"] != -100).float().mean()))
        losses.append(float(pm.step(batch, None)))
        scheduler.step()
        if pm.step_count % args.eval_every == 0:
            evals.append(float(pm.evaluate(held_out, None)))
        if pm.step_count % args.save_every == 0:
            save(pm, args.out)
    return {"losses": losses, "evals": evals, "steps": pm.step_count, "lr": pm.optimizer.param_groups[0]["lr"],
            "real_fraction": real}


if __name__ == "__main__":
    result = main()
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"trained to step {result['steps']}: last loss {result['losses'][-1]:.4f}, "
              f"held-out losses {[round(v, 4) for v in result['evals']]}"
              + (f", {sum(result['real_fraction']) / len(result['real_fraction']):.0%} of the slots real tokens"
                 if result.get("real_fraction") else ""))
    if dist.is_initialized():
        dist.destroy_process_group()
