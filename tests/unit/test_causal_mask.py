"""passes/causal_mask.py: a statically causal attention mask becomes SDPA's ``is_causal``.

On tiny Hugging Face models built here: Llama and Qwen2 (with and without ``use_cache``: two
mask graphs), Mistral with a window as long as the sequence (causal) and shorter (kept), and a
padding mask from the inputs (kept). Where the pass rewrites, the mask's computation is gone from
the graph, and the rewritten graph's loss and every gradient equal eager PyTorch's on the same
module (``torch.func.functional_call``). A hand-built mask of another form (``q <= kv``, the
anti-causal one) is kept.
"""
import pytest
import torch
import torch.nn.functional as F

from autopar.passes.capture import capture
from tests.hf_models import build_hf, hf_lm_loss


def _sdpas(cap):
    return [n for n in cap.gm.graph.nodes if n.op == "call_function"
            and n.target is torch.ops.aten.scaled_dot_product_attention.default]


def _square_bool(cap, s):
    return [n for n in cap.gm.graph.nodes if n.op == "call_function" and isinstance(n.meta.get("val"), torch.Tensor)
            and n.meta["val"].dtype == torch.bool and tuple(n.meta["val"].shape[-2:]) == (s, s)]


def _loss_and_grads(cap, model, ids, target, attention_mask=None):
    """The captured graph run on the model's own tensors, against eager autograd on the module."""
    params = dict(model.named_parameters())
    gm_inputs = []
    for n in cap.gm.graph.nodes:
        if n.op != "placeholder":
            continue
        if n.name in cap.params:
            gm_inputs.append(params[cap.params[n.name]])
        elif n.name in cap.buffers:
            gm_inputs.append(dict(model.named_buffers())[cap.buffers[n.name]])
        elif n.name in cap.constants:
            gm_inputs.append(cap.constants[n.name])
    gm_inputs += [ids] + ([attention_mask] if attention_mask is not None else []) + [target]
    outs = cap.gm(*gm_inputs)
    loss = outs[-1] if isinstance(outs, (tuple, list)) else outs
    return loss, torch.autograd.grad(loss, list(params.values()))


@pytest.mark.parametrize("name,use_cache,window,causal", [
    ("llama", True, None, True), ("llama", False, None, True), ("qwen2", False, None, True),
    ("mistral", False, 16, True), ("mistral", False, 8, False)])
def test_hf_masks(name, use_cache, window, causal):
    import transformers as tf

    seq = 16
    model = build_hf(name, use_cache=use_cache)
    if window is not None:
        cfg = model.config
        cfg.sliding_window = window
        torch.manual_seed(0)
        model = tf.AutoModelForCausalLM.from_config(cfg)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 128, (2, seq), generator=g)
    target = torch.randint(0, 128, (2, seq), generator=g)
    cap = capture(model, (ids,), target, hf_lm_loss)
    sdpas = _sdpas(cap)
    assert sdpas
    for n in sdpas:
        has_mask = len(n.args) > 3 and n.args[3] is not None
        assert (n.kwargs.get("is_causal", False) and not has_mask) == causal, (n.args, n.kwargs)
    assert (not _square_bool(cap, seq)) == causal  # the mask's computation is gone with it
    loss, grads = _loss_and_grads(cap, model, ids, target)
    want = hf_lm_loss(model(ids), target)
    want_grads = torch.autograd.grad(want, list(model.parameters()))
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)
    for a, b in zip(grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_padding_and_other_masks_are_kept():
    model = build_hf("llama")
    ids = torch.randint(0, 128, (2, 16))
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[1, :5] = 0
    cap = capture(model, (ids, mask), ids, hf_lm_loss, input_names=("input_ids", "attention_mask"))
    assert all(not n.kwargs.get("is_causal", False) for n in _sdpas(cap))

    class AntiCausal(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(8, 8)

        def forward(self, x):
            q = self.proj(x).view(2, 1, 16, 8)
            pos = torch.arange(16)
            m = pos[None, :] >= pos[:, None]  # kv >= q: attends to the future
            return F.scaled_dot_product_attention(q, q, q, attn_mask=m).sum()

    cap = capture(AntiCausal(), (torch.randn(2, 16, 8),))
    assert all(not n.kwargs.get("is_causal", False) and n.args[3] is not None for n in _sdpas(cap))
