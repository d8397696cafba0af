"""examples/train.py end to end on 2 gloo processes (issue 14, C8): 4 steps of pp=2 with a
checkpoint every 2 of a 6-step run stopped at step 4 (``--stop-at``), then fresh processes resume
from the latest checkpoint and train to step 6.
The 6 losses and the held-out losses equal a single-process eager run of the same recipe: the
model initialized as ``autopar.init_weights`` does, the same DistributedSampler order, AdamW
with no weight decay on norms and biases, the warmup+cosine LambdaLR, clip_grad_norm_(1.0).
"""
import os

import pytest

from tests.dist.harness import run_shared

ARGS = ["--pp", "2", "--layers", "2", "--d-model", "32", "--seq", "16", "--vocab", "64", "--batch", "8",
        "--microbatches", "2", "--warmup", "2", "--eval-every", "2", "--save-every", "2", "--log-every", "100"]


def _train(rank, world, argv):
    from autopar.examples import train

    return train.main(argv)


def _recipe(seq: int, steps: int, eval_every: int, step_loss, eval_loss):
    """examples/train.py's recipe in one process, with torch alone (plus init_weights, the
    documented eager reproduction of autopar's initialization): the GPT, AdamW without weight
    decay on norms and biases, the warmup+cosine LambdaLR, clip_grad_norm_(1.0);
    ``step_loss(model, step)``: the loss of a step's global batch, ``eval_loss(model)``: the
    held-out loss. Returns (losses, held-out losses)."""
    import torch

    import autopar
    from autopar.examples import train
    from autopar.examples.gpt import GPT, GPTConfig

    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=64, seq_len=seq, n_layer=2, n_head=4, d_model=32))
    autopar.init_weights(model, seed=0)
    params = dict(model.named_parameters())
    groups = [{"params": [p for f, p in params.items() if not train.no_decay(f, p)]},
              {"params": [p for f, p in params.items() if train.no_decay(f, p)], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=3e-3, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, train.warmup_cosine(2, steps))
    losses, evals = [], []
    for step in range(1, steps + 1):
        loss = step_loss(model, step)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        sched.step()
        losses.append(float(loss.detach()))
        if step % eval_every == 0:
            with torch.no_grad():
                evals.append(float(eval_loss(model)))
    return losses, evals


def _eager(steps: int, eval_every: int):
    """The recipe on the DistributedSampler's order of the synthetic token rows."""
    from torch.utils.data import DataLoader, DistributedSampler

    from autopar.examples import train
    from autopar.examples.gpt import gpt_loss

    data, held_out = train.Tokens(40 * 8, 16, 64, seed=0), train.Tokens(8, 16, 64, seed=1)
    sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0, drop_last=True)
    sampler.set_epoch(0)
    batches = iter(DataLoader(data, batch_size=8, sampler=sampler, drop_last=True))

    def step_loss(model, _step):
        x, y = next(batches)
        return gpt_loss(model(x), y)

    return _recipe(16, steps, eval_every, step_loss,
                   lambda model: gpt_loss(model(held_out.data[:, :-1]), held_out.data[:, 1:]))


@pytest.mark.slow
def test_train_example_saves_and_resumes(tmp_path):
    out = str(tmp_path / "run")
    first = run_shared(_train, 2, ARGS + ["--steps", "6", "--stop-at", "4", "--out", out], deadline_s=240)
    assert sorted(os.listdir(out)) == ["latest", "step000002", "step000004"]
    with open(os.path.join(out, "latest")) as fh:
        assert fh.read() == "step000004"
    assert os.path.exists(os.path.join(out, "step000004", ".metadata"))
    # fresh processes, the same command with --resume and more steps: it continues at step 5
    second = run_shared(_train, 2, ARGS + ["--steps", "6", "--out", out, "--resume"], deadline_s=240)
    ref_losses, ref_evals = _eager(6, 2)
    for rank in range(2):  # both pipeline ranks report the step's loss
        a, b = first[rank], second[rank]
        assert a["steps"] == 4 and b["steps"] == 6 and len(b["losses"]) == 2, (a, b)
        for step, (got, want) in enumerate(zip(a["losses"] + b["losses"], ref_losses), start=1):
            assert abs(got - want) <= 1e-5 * abs(want), f"rank {rank} step {step}: {got} vs eager {want}"
        for got, want in zip(a["evals"] + b["evals"], ref_evals):
            assert abs(got - want) <= 1e-5 * abs(want), (rank, a["evals"] + b["evals"], ref_evals)
        assert len(a["evals"] + b["evals"]) == 3
    assert sorted(os.listdir(out)) == ["latest", "step000002", "step000004", "step000006"]


PACKED = ["--packed", "--pp", "2", "--layers", "2", "--d-model", "32", "--seq", "32", "--vocab", "64", "--batch", "4",
          "--microbatches", "2", "--warmup", "2", "--eval-every", "2", "--save-every", "2", "--log-every", "100"]


def _eager_packed(steps: int, eval_every: int):
    """``--packed``'s recipe: the same packed batches, one forward of the whole global batch per
    step (the model's own loss: the mean over every real token)."""
    import autopar.data
    from autopar.examples import train

    stream = autopar.data.packed_batches(train.documents(32, 64, seed=0), 32, 4, groups=2)
    held_out = next(autopar.data.packed_batches(train.documents(32, 64, seed=1), 32, 4, groups=2))
    return _recipe(32, steps, eval_every, lambda model, _step: model(**next(stream)), lambda model: model(**held_out))


@pytest.mark.slow
def test_train_example_packed(tmp_path):
    """Issue 37 V4: ``--packed`` trains pp=2 on packed documents, stops at step 2 and resumes to
    step 4; losses and held-out losses equal the eager recipe on the same batches."""
    out = str(tmp_path / "packed")
    first = run_shared(_train, 2, PACKED + ["--steps", "4", "--stop-at", "2", "--out", out], deadline_s=240)
    second = run_shared(_train, 2, PACKED + ["--steps", "4", "--out", out, "--resume"], deadline_s=240)
    ref_losses, ref_evals = _eager_packed(4, 2)
    for rank in range(2):
        a, b = first[rank], second[rank]
        got = a["losses"] + b["losses"]
        assert len(got) == 4 and all(f < 1.0 for f in a["real_fraction"] + b["real_fraction"])
        for step, (g, w) in enumerate(zip(got, ref_losses), start=1):
            assert abs(g - w) <= 1e-5 * abs(w), f"rank {rank} step {step}: {g} vs eager {w}"
        for g, w in zip(a["evals"] + b["evals"], ref_evals, strict=True):
            assert abs(g - w) <= 1e-5 * abs(w), (rank, a["evals"] + b["evals"], ref_evals)
