"""Meta-device builds of models people bring, in local mode (issue 19 R7): a Hugging Face Llama
(tied embeddings) built on meta from its config gets its non-persistent RoPE buffers recomputed
and equals eager ``from_pretrained`` on its own ``save_pretrained`` directory, or
``autopar.init_weights`` without weights; a tie missing on the meta model is tied as the model
declares it; a buffer-only module is rebuilt as a CPU twin; a buffer nothing computes is a
ValueError naming it (design.md §5: losses 1e-5, parameters 1e-4, two steps).
"""
import functools

import pytest
import torch
import torch.nn as nn

STEPS, SEED = 2, 3
PLAN = dict(pp=2, schedule="1f1b", num_microbatches=2)


@pytest.fixture(scope="module", autouse=True)
def _one_capture():
    """The three Llama runs share one capture (tests/models.memoized_capture; all tied, one shape)."""
    import autopar.passes
    from tests.models import memoized_capture

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(autopar.passes, "capture", memoized_capture(autopar.passes.capture))
        yield


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A CPU-built tied Llama's save_pretrained directory and eager from_pretrained on it."""
    import transformers as tf

    path = tmp_path_factory.mktemp("llama")
    torch.manual_seed(0)
    tf.AutoModelForCausalLM.from_config(_cfg(), attn_implementation="sdpa").save_pretrained(path)
    return str(path), tf.AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa").train()


def _cfg():
    from tests.hf_models import _config

    cfg = _config("llama")
    cfg.tie_word_embeddings, cfg.use_cache = True, False
    return cfg


def _meta_llama():
    import transformers as tf

    with torch.device("meta"):
        return tf.AutoModelForCausalLM.from_config(_cfg(), attn_implementation="sdpa")


def _batch():
    from tests.hf_models import VOCAB

    g = torch.Generator().manual_seed(1)
    return torch.randint(0, VOCAB, (4, 8), generator=g), torch.randint(0, VOCAB, (4, 8), generator=g)


def _opt():
    return functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.1, eps=1e-4)


def _train(model, ids, target, **kw):
    import autopar
    from tests.hf_models import hf_lm_loss

    pm = autopar.parallelize(model, (ids,), loss_fn=hf_lm_loss, optimizer=_opt(), plan=autopar.Plan(**PLAN),
                             example_target=target, **kw)
    start = {k: v.clone() for k, v in pm.state_dict().items()}
    return pm, start, [pm.step((ids,), target) for _ in range(STEPS)]


def _check(pm, losses, eager, ids, target):
    from tests.hf_models import hf_lm_loss
    from tests.reference import assert_close_state, eager_reference

    ref_losses, ref_state = eager_reference(eager, (ids,), target, hf_lm_loss, _opt(),
                                            num_microbatches=PLAN["num_microbatches"], steps=STEPS)
    for got, want in zip(losses, ref_losses):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
    assert_close_state(pm.state_dict(), ref_state, rtol=1e-4)


@pytest.mark.parametrize("untie", [False, True], ids=["tied", "tie-broken-on-meta"])
def test_meta_hf_with_weights_equals_from_pretrained(saved, untie):
    path, eager = saved
    model = _meta_llama()
    if untie:  # the checkpoint stores the tied pair once: it is tied again as the model declares it
        model.lm_head.weight = nn.Parameter(torch.empty(model.lm_head.weight.shape, device="meta"))
    ids, target = _batch()
    pm, _, losses = _train(model, ids, target, weights=path)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    rope = model.model.rotary_emb
    for name in ("inv_freq", "original_inv_freq"):  # recomputed as transformers does, bit for bit
        assert torch.equal(getattr(rope, name), getattr(eager.model.rotary_emb, name)), name
    _check(pm, losses, eager, ids, target)


def test_meta_hf_without_weights_equals_init_weights():
    import autopar

    ids, target = _batch()
    pm, start, losses = _train(_meta_llama(), ids, target, seed=SEED)
    eager = autopar.init_weights(_meta_llama(), seed=SEED)
    for k, v in eager.state_dict().items():
        assert torch.equal(start[k], v), k
    cpu = __import__("transformers").AutoModelForCausalLM.from_config(_cfg())
    assert torch.equal(eager.model.rotary_emb.inv_freq, cpu.model.rotary_emb.inv_freq)
    _check(pm, losses, eager, ids, target)


class _Table(nn.Module):
    """Buffer-only state computed in the constructor; ``keep`` stores the argument it needs."""

    def __init__(self, n: int, scale: float = 2.0, keep: bool = True):
        super().__init__()
        if keep:
            self.n = n
        self.scale, self.keep = scale, keep
        self.register_buffer("table", torch.arange(n, dtype=torch.float32) * scale, persistent=False)


class _Net(nn.Module):
    def __init__(self, keep: bool):
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.pos = _Table(6, scale=0.5, keep=keep)

    def forward(self, x):
        return self.fc(x) + self.pos.table


def _net_train(model, state):
    import autopar

    x, y = torch.randn(4, 6, generator=torch.Generator().manual_seed(0)), torch.randn(4, 6)
    pm = autopar.parallelize(model, (x,), loss_fn=nn.functional.mse_loss, optimizer=_opt(), example_target=y,
                             plan=autopar.Plan(num_microbatches=2), weights=state)
    return pm, x, y


def test_buffer_only_module_rebuilt_as_cpu_twin():
    from tests.reference import eager_reference

    torch.manual_seed(0)
    eager = _Net(keep=True)
    with torch.device("meta"):
        model = _Net(keep=True)
    pm, x, y = _net_train(model, eager.state_dict())
    assert torch.equal(model.pos.table, eager.pos.table)
    ref_losses, _ = eager_reference(eager, (x,), y, nn.functional.mse_loss, _opt(), num_microbatches=2, steps=1)
    torch.testing.assert_close(pm.step((x,), y), ref_losses[0], rtol=1e-5, atol=0)


def test_buffer_left_on_meta_is_a_value_error_naming_it():
    torch.manual_seed(0)
    state = _Net(keep=False).state_dict()
    with torch.device("meta"):
        model = _Net(keep=False)
    with pytest.raises(ValueError, match=r"pos\.table \(shape \(6,\), torch.float32, in _Table: .*'n' is not an "
                                         r"attribute.*init_fn="):
        _net_train(model, state)


def test_buffer_values_equal_cpu_construction_for_hf_families():
    """RoPE tables (inv_freq, original_inv_freq), Gemma2's embed_scale, BERT's position_ids and
    token_type_ids: transformers' own _init_weights path, bit for bit what the constructor gives."""
    import transformers as tf

    from autopar.runtime.materialize import buffer_values, non_persistent_buffers
    from tests.hf_models import _config

    seen = set()
    for name in ("llama", "gemma2", "bert"):  # every kind of non-persistent buffer in tests/hf_models
        cls = tf.BertForMaskedLM if name == "bert" else tf.AutoModelForCausalLM.from_config
        with torch.device("meta"):
            meta = cls(_config(name))
        cpu = cls(_config(name))
        want = non_persistent_buffers(cpu)
        got = buffer_values(meta)
        assert sorted(got) == sorted(want), name
        for f, v in want.items():
            assert got[f].dtype == v.dtype and torch.equal(got[f], v), f"{name} {f}"
            seen.add(f.rpartition(".")[2])
    assert {"inv_freq", "original_inv_freq", "embed_scale", "position_ids", "token_type_ids"} <= seen
