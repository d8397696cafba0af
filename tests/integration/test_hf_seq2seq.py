"""R3: an encoder-decoder Hugging Face model, unmodified (tiny T5: a learned relative position
bias as SDPA mask, cross-attention on the encoder output, ``input_ids``, ``attention_mask``,
``decoder_input_ids`` and ``labels`` in the batch dict, the model's own loss), in local mode
at pp=1 against single-process eager PyTorch (design.md §5: loss 1e-5 relative, parameters
after two SGD steps 1e-4); and context parallelism's refusal of its learned mask, by name.
pp=2 (zbv, the encoder output crossing into the decoder stages) runs on 2 gloo processes in
tests/dist/test_hf_pipeline.py."""
import functools

import torch

from tests.hf_models import make_hf, seq2seq_batch
from tests.reference import assert_close_state, eager_reference


class _Keywords(torch.nn.Module):
    """The eager reference of a dict batch: positional tensors passed on as keywords, the model's loss."""

    def __init__(self, model, names):
        super().__init__()
        self.model, self.names = model, names

    def forward(self, *tensors):
        return self.model(**dict(zip(self.names, tensors))).loss


def test_t5_local_matches_eager_and_cp_refuses_its_learned_mask(monkeypatch):
    import autopar.passes
    from autopar.passes.context_parallel import context_parallel_blocker

    captured = []
    capture = autopar.passes.capture
    monkeypatch.setattr(autopar.passes, "capture", lambda *a, **k: captured.append(capture(*a, **k)) or captured[-1])
    case = make_hf("t5", seed=0, batch=4, seq=16)
    batch = seq2seq_batch(case)
    sgd = functools.partial(torch.optim.SGD, lr=0.5)
    ref_losses, ref_state = eager_reference(_Keywords(case.model, tuple(batch)), tuple(batch.values()), None, None,
                                            sgd, num_microbatches=2, steps=2)
    pm = autopar.parallelize(case.model, batch, loss_fn=None, optimizer=sgd, plan=autopar.Plan(num_microbatches=2))
    for want in ref_losses:
        torch.testing.assert_close(pm.step(batch, None), want, rtol=1e-5, atol=0)
    assert_close_state(pm.state_dict(), {k.removeprefix("model."): v for k, v in ref_state.items()}, rtol=1e-4)

    # Plan(cp=2) on it (a process per rank) raises this from apply_context_parallel; the planner skips cp=2
    reason = context_parallel_blocker(captured[-1], 2)
    assert reason is not None and "depends on a parameter (a learned bias)" in reason, reason
    assert "Use cp=1" in reason and "modeling_t5.py" in reason, reason
