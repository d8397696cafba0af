"""Issue 37 V1 under context parallelism: packed rows (``autopar.data.pack``) through a causal
LM's own loss from labels equal their documents run one at a time in eager PyTorch (loss 1e-5,
every gradient 1e-4, read off one SGD step at lr 1), at cp=2 and pp=2 x cp=2 (zbv), on HF Llama,
HF Mistral (a sliding window shorter than the documents) and this repository's GPT; and under
tensor parallelism with sequence parallelism: tp=2 (GPT, HF Llama).

What it takes: the per-document mask derived in the graph from ``position_ids`` (a running sum
over the positions) is rebuilt over the whole sequence on every cp rank, never from a shard
(passes/context_parallel.py); the targets of each shard's last token come from the next shard
(``shift_labels``, autopar/batches.with_shift_labels); each cp rank's mean loss weighs the valid
targets of its shard over those of the global batch (``label_scales``). Without either, the
gradients are off by ~2e-2.

One process group per world size runs every model of that size.
"""
import functools

import pytest
import torch

from tests.dist.harness import run_shared

pytestmark = pytest.mark.slow

MODELS = ("gpt", "llama", "mistral")
PLANS = {2: dict(cp=2, num_microbatches=2), 4: dict(pp=2, cp=2, schedule="zbv", num_microbatches=4)}
# packed rows under tensor parallelism too (the mask stays replicated; the heads are sharded): tp=2
# with sequence parallelism (cp x tp composes in tests/dist/test_tensor_parallel.py)
TP_PLANS = {2: dict(tp=2, sequence_parallel=True, num_microbatches=2)}
TP_MODELS = {2: ("gpt", "llama"), 4: ()}


def _docs():
    from autopar.data import pack

    g = torch.Generator().manual_seed(1)
    splits = [(10, 22), (17, 10, 5), (5, 7, 12, 8), (20, 9, 3)]
    docs = [torch.randint(1, 128, (n,), generator=g) for s in splits for n in s]
    return docs, pack(docs, 32, rows=4)


def _model(name: str):
    if name == "gpt":
        from autopar.examples.gpt import GPT, GPTConfig

        torch.manual_seed(0)
        return GPT(GPTConfig(vocab_size=128, seq_len=32, n_layer=2, n_head=2, d_model=32))
    from tests.hf_models import build_hf

    return build_hf(name, seed=0, use_cache=False)


def _run(rank, world, names):
    import traceback

    import autopar

    out = []
    _docs_, batch = _docs()
    for name, plan in [(n, PLANS[world]) for n in names] + [(n, TP_PLANS[world]) for n in TP_MODELS[world]]:
        try:
            model = _model(name)
            before = {n: p.detach().clone() for n, p in model.named_parameters()}
            pm = autopar.parallelize(model, batch, loss_fn=None, optimizer=functools.partial(torch.optim.SGD, lr=1.0),
                                     plan=autopar.Plan(**plan), timeout=60)
            loss = pm.step(batch, None)
            state = pm.state_dict()
            out.append({"loss": loss, "change": {n: before[n] - state[n] for n in before}})
        except Exception:  # noqa: BLE001 - report per model
            out.append({"traceback": traceback.format_exc()})
    return out


@pytest.mark.parametrize("world", sorted(PLANS))
def test_packed_rows_under_context_parallel_equal_documents_run_separately(world):
    from tests.unit.test_data import _separate

    per_rank = run_shared(_run, world, MODELS, deadline_s=600, reuse=False)
    docs, _batch = _docs()
    failures = []
    for i, (name, plan) in enumerate([(n, PLANS[world]) for n in MODELS] + [(n, TP_PLANS[world]) for n in TP_MODELS[world]]):
        try:
            want_loss, want_grads = _separate(_model(name), docs)
            for r in range(world):
                res = per_rank[r][i]
                assert "traceback" not in res, f"rank {r}:\n{res.get('traceback')}"
                torch.testing.assert_close(res["loss"], want_loss, rtol=1e-5, atol=0)
                for n, grad in want_grads.items():
                    torch.testing.assert_close(res["change"][n], grad, rtol=1e-4, atol=1e-6, msg=f"rank {r} {n}")
        except AssertionError as e:
            failures.append(f"{name} {plan}: {e}")
    assert not failures, "\n".join(failures)
