"""autopar.data: the packer's contract by brute force, its fill and balance on a realistic length
distribution (issue 37 V2), and packed rows equal to their documents run one by one in eager
transformers (V1, local mode): the step's loss is the mean over every real token of the global
batch, whatever each microbatch holds (design.md §5 loss normalization)."""
import copy
import functools
import math
import random

import pytest
import torch
import torch.nn.functional as F

import autopar
from autopar.data import _best_fit_decreasing, balance, pack, row_cost


def test_pack_contract_by_brute_force():
    """Every document (a long one cut into row-long pieces) lies whole in one row, positions
    0..n-1, its tokens as labels but -100 on its first position; everything else is padding
    (pad id, label -100, position 0); rows are a multiple of groups."""
    g = torch.Generator().manual_seed(0)
    lengths = [5, 16, 3, 40, 9, 1, 12, 7]
    docs = [torch.randint(1, 100, (n,), generator=g) for n in lengths]
    batch = pack(docs, 16, groups=4)
    ids, pos, labels = batch["input_ids"], batch["position_ids"], batch["labels"]
    assert ids.shape[0] % 4 == 0 and ids.shape[1] == 16
    pieces = [p for d in docs for p in d.split(16)]
    used = torch.zeros_like(ids, dtype=torch.bool)
    for p in pieces:
        n = p.numel()
        hits = [(r, c) for r in range(ids.shape[0]) for c in range(16 - n + 1)
                if not used[r, c:c + n].any() and torch.equal(ids[r, c:c + n], p)
                and torch.equal(pos[r, c:c + n], torch.arange(n))]
        assert hits, f"piece of {n} tokens not found whole"
        r, c = hits[0]
        used[r, c:c + n] = True
        assert labels[r, c] == -100 and torch.equal(labels[r, c + 1:c + n], p[1:])
    assert (ids[~used] == 0).all() and (labels[~used] == -100).all() and (pos[~used] == 0).all()
    assert int(used.sum()) == sum(lengths)
    with pytest.raises(ValueError, match="need 2 rows of 16 tokens, more than rows=1"):
        pack([torch.ones(10, dtype=torch.long)] * 2, 16, rows=1)


def test_fill_and_balance_on_log_normal_lengths():
    """V2: 10,000 document lengths from a log-normal (median 600, sigma 1), rows of 4096:
    best-fit decreasing fills >= 97% of the slots; balanced into 32 slices (dp x microbatches)
    the largest slice costs <= 1.05x the mean."""
    rng = random.Random(0)
    lengths = [max(1, int(rng.lognormvariate(math.log(600), 1.0))) for _ in range(10_000)]
    pieces = [min(4096, n - k) for n in lengths for k in range(0, n, 4096)]
    rows = _best_fit_decreasing(pieces, 4096)
    assert sorted(i for r in rows for i in r) == list(range(len(pieces)))
    assert all(sum(pieces[i] for i in r) <= 4096 for r in rows)
    fill = sum(pieces) / (len(rows) * 4096)
    assert fill >= 0.97, fill
    rows += [[] for _ in range(-len(rows) % 32)]
    costs = [row_cost([pieces[i] for i in r], seq_len=4096) for r in rows]
    order = balance(costs, 32)
    assert sorted(order) == list(range(len(rows)))
    size = len(rows) // 32
    slices = [sum(costs[i] for i in order[k * size:(k + 1) * size]) for k in range(32)]
    assert max(slices) <= 1.05 * (sum(slices) / 32), (max(slices), sum(slices) / 32)


def _separate(model, docs):
    """The documents one by one in eager transformers: the summed token loss over all real
    tokens (each predicts its next) divided by their count; the gradients of that."""
    model.zero_grad()
    total, count = 0.0, 0
    for d in docs:
        out = model(input_ids=d[None])
        logits = getattr(out, "logits", out)[0]
        total = total + F.cross_entropy(logits[:-1].float(), d[1:], reduction="sum")
        count += d.numel() - 1
    loss = total / count
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("plan", [dict(pp=1, num_microbatches=1), dict(pp=1, num_microbatches=2),
                                  dict(pp=2, schedule="zbv", num_microbatches=4), dict(dp=2, num_microbatches=2)],
                         ids=["pp1", "pp1-m2", "pp2-zbv", "dp2-local"])
def test_packed_rows_equal_documents_run_separately(plan):
    """V1 (local mode): a packed batch through the model's own loss (labels in the batch,
    loss_fn=None) equals its documents run one at a time in eager transformers: loss 1e-5,
    every gradient 1e-4 (read after one SGD step at lr 1: the parameter change). The rows hold
    two to four documents of 32 tokens in all (cut across the stage boundary at pp=2), so the
    microbatches hold different numbers of real labels (27 to 30): a mean of
    per-microbatch means would differ from the mean over all real tokens."""
    from tests.hf_models import build_hf

    _check_packed(build_hf("llama", seed=0, use_cache=False), plan)


@pytest.mark.parametrize("plan", [dict(pp=1, num_microbatches=2), dict(pp=2, schedule="zbv", num_microbatches=4)],
                         ids=["pp1-m2", "pp2-zbv"])
def test_packed_rows_equal_documents_run_separately_gpt(plan):
    """V1 on this repository's GPT: position_ids embed each token at its place in its document
    and mask attention to the document; labels give its own loss."""
    from autopar.examples.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    _check_packed(GPT(GPTConfig(vocab_size=128, seq_len=32, n_layer=2, n_head=2, d_model=32)), plan)


def test_packed_rows_equal_documents_run_separately_sliding_window():
    """V1 on HF Mistral, whose sliding window (8) is shorter than most documents, at pp=2 zbv."""
    from tests.hf_models import build_hf

    _check_packed(build_hf("mistral", seed=0, use_cache=False), dict(pp=2, schedule="zbv", num_microbatches=4))


def _check_packed(model, plan):
    g = torch.Generator().manual_seed(1)
    splits = [(10, 22), (17, 10, 5), (5, 7, 12, 8), (20, 9, 3)]
    docs = [torch.randint(1, 128, (n,), generator=g) for s in splits for n in s]
    batch = pack(docs, 32, rows=4)
    counts = sorted(int((row[1:] != -100).sum()) for row in batch["labels"])
    assert counts == [27, 29, 30, 30], counts  # best-fit decreasing's rows of these documents
    ref = copy.deepcopy(model)
    want_loss, want_grads = _separate(ref, docs)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    pm = autopar.parallelize(model, batch, loss_fn=None, optimizer=functools.partial(torch.optim.SGD, lr=1.0),
                             plan=autopar.Plan(**plan))
    loss = pm.step(batch, None)
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=0)
    state = pm.state_dict()
    for name, grad in want_grads.items():
        torch.testing.assert_close(before[name] - state[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_packed_rows_with_an_all_ones_mask_are_refused():
    """Issue 37: an all-ones attention_mask would hide the document boundaries from transformers."""
    from autopar.batches import as_inputs

    docs = [torch.arange(1, 6), torch.arange(1, 4)]
    batch = pack(docs, 8)
    as_inputs(batch)  # as packed: no mask, accepted
    with pytest.raises(ValueError, match=r"rows \[0\] hold packed documents .* drop attention_mask"):
        as_inputs({**batch, "attention_mask": torch.ones_like(batch["input_ids"])})
    padded = {"input_ids": torch.ones(2, 4, dtype=torch.long),
              "position_ids": torch.tensor([[1, 1, 0, 1], [0, 1, 2, 3]]),
              "attention_mask": torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])}
    as_inputs(padded)  # left padding (HF's positions for padded rows): the mask is not all ones there


def test_shift_labels_for_context_parallel():
    """cp > 1 and a causal LM's own loss: the labels shifted over the whole sequence are added
    as shift_labels (the next shard's first label is the target of a shard's last token); a
    forward that cannot take them is refused, naming the fix; nothing changes at cp = 1."""
    from autopar.batches import with_shift_labels
    from autopar.examples.gpt import GPT, GPTConfig

    labels = torch.tensor([[-100, 5, 6, 7], [-100, 8, -100, 9]])
    inputs, names = (torch.zeros(2, 4, dtype=torch.long), labels), ("input_ids", "labels")
    gpt = GPT(GPTConfig(vocab_size=16, seq_len=4, n_layer=1, n_head=1, d_model=8))
    got, got_names = with_shift_labels(inputs, names, gpt, None, 2)
    assert got_names == ("input_ids", "labels", "shift_labels")
    assert torch.equal(got[2], torch.tensor([[5, 6, 7, -100], [8, -100, 9, -100]]))
    assert with_shift_labels(inputs, names, gpt, None, 1) == (inputs, names)

    class NoShift(torch.nn.Module):
        def forward(self, input_ids, labels):
            return input_ids.float().mean()

    with pytest.raises(ValueError, match="to take shift_labels"):
        with_shift_labels(inputs, names, NoShift(), None, 2)


def test_packed_batches_lose_nothing_and_fill_greedily():
    """A stream cut into batches of exactly `rows` rows: every document piece appears once, in
    stream order across batches (a long document's pieces may span two); each batch's next piece
    would not have fit (best-fit decreasing over the batch's pieces plus it needs more rows)."""
    from autopar.data import packed_batches

    g = torch.Generator().manual_seed(3)
    lengths = [int(x) for x in torch.randint(1, 40, (60,), generator=g)] + [70]  # one longer than 2 rows
    docs = [torch.randint(1, 100, (n,), generator=g) for n in lengths]
    out = list(packed_batches(iter(docs), 16, 3))
    pieces = [p for d in docs for p in d.split(16)]
    seen = []
    for batch in out:
        assert batch["input_ids"].shape == (3, 16)
        got = []
        for r in range(3):
            row, pos = batch["input_ids"][r], batch["position_ids"][r]
            starts = [c for c in range(16) if pos[c] == 0] + [16]
            for a, b in zip(starts, starts[1:]):
                if batch["labels"][r, a + 1:b].ne(-100).any() or b - a == 1 and row[a] != 0:
                    got.append(row[a:b])
        seen.append(got)
    flat = [p for got in seen for p in got]
    assert sorted(tuple(p.tolist()) for p in flat) == sorted(tuple(p.tolist()) for p in pieces)
    # greedy: the first piece of each next batch did not fit in the batch before it
    k = 0
    for got in seen[:-1]:
        k += len(got)
        before = [int(p.numel()) for p in pieces[k - len(got):k]]
        assert len(_best_fit_decreasing(before + [int(pieces[k].numel())], 16)) > 3


def test_the_readme_spelling_works_after_import_autopar_alone():
    """``autopar.data.pack(...)`` as the README writes it, in a process that imported nothing but
    ``autopar`` (in this one, other tests may have imported autopar.data already)."""
    import subprocess
    import sys

    code = ("import torch, autopar; b = autopar.data.pack([torch.arange(1, 6), torch.arange(1, 4)], seq_len=8, "
            "groups=1); print(type(b).__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
