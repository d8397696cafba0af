"""The planner's tensor-parallel axis (issue 38 item 4): what a unit shards at each tp degree
against hand counts from the preset's config, a tp rank's unit (parameters / tp, the all-reduces
added), the search over tp, ``--pin tp=``, and the runtime plan it returns."""
import pytest

from autopar.planner import presets
from autopar.planner.devices import get_profile
from autopar.planner.profile import profile_model
from autopar.planner.search import Request, plan, to_plan

SEQ = 256


@pytest.fixture(scope="module")
def llama8b():
    pm = presets.build_preset("llama3-8b", seq_len=SEQ)
    return profile_model(pm.model, pm.inputs, pm.target, pm.loss_fn, name=pm.name, layer_repeats=pm.layer_repeats,
                         n_heads=pm.n_heads, seq_len=SEQ)


def test_a_layer_shards_its_projections_by_hand_count(llama8b):
    d, heads, kv, ffn = 4096, 32, 8, 14336  # Llama 3 8B's published config
    hd = d // heads
    linears = d * d * 2 + d * kv * hd * 2 + 3 * d * ffn  # q, o; k, v; gate, up, down
    layer = next(u.kind for u in llama8b.units if u.name.startswith("layers."))
    assert layer.params == linears + 2 * d  # + the two RMSNorm weights, replicated
    for tp in (2, 4, 8):
        sh = layer.tp_share(tp)
        assert sh is not None and sh.params == linears and sh.param_bytes == 2 * linears  # bf16
        # two sums per forward (attention out, MLP out), each [1, SEQ, d] in bf16
        assert sh.reduces == 2 and sh.reduce_bytes == 2 * SEQ * d * 2
        # by hand at SEQ=256 (the roofline weights of tp_share._op_weight): the sharded GEMMs 2 * SEQ *
        # linears FLOPs = 112 us + their element-wise ops ~20 us; the two RMSNorms and residual adds,
        # replicated, ~12 ops of [SEQ, d] ~37 us: a share of about 0.78
        assert sh.attention and 0.7 < sh.flops < 0.9
        # sequence parallelism: both sums reduce-scattered, both column inputs (the attention's and
        # the MLP's, after their RMSNorms) all-gathered, each [1, SEQ, d] in bf16; the residual
        # stream in and out token-sharded; nothing F keeps stays whole (I gathers the column
        # inputs again: their share, of the token-sharded one, is whole again from I to W)
        assert sh.scatters == (2, 2 * SEQ * d * 2) and sh.gathers == (2, 2 * SEQ * d * 2)
        # (the layer also receives the RoPE tables, replicated: a few % of its input bytes)
        assert 0.9 < sh.boundary[0] < 1 and sh.boundary[1] == 1
        assert sh.activations + sh.sequence == pytest.approx(1.0) and 0 < sh.regathered < sh.sequence
        one = layer.at_tp(tp)
        assert one.params == linears // tp + 2 * d
        assert one.tp_comm == (0, 0, tp) and one.sp_comm == (2, 2 * SEQ * d * 2, 2, 2 * SEQ * d * 2)
        assert one.time_scale == pytest.approx(1 - sh.flops + sh.flops / tp)
        # in: the hidden states [1, SEQ, d] / tp, the RoPE tables whole (what the layer gets beyond its output)
        rope = layer.in_bytes - SEQ * d * 2
        assert one.out_bytes == layer.out_bytes / tp == SEQ * d * 2 / tp
        assert one.in_bytes == pytest.approx(SEQ * d * 2 / tp + rope)
        cut = sh.activations + sh.sequence
        assert one.saved_bytes == pytest.approx(layer.saved_bytes * (1 - cut + cut / tp))
        assert one.saved_after_i == pytest.approx(layer.saved_after_i * (1 - cut + cut / tp
                                                                          + sh.regathered * (1 - 1 / tp)))
    # the token embedding is vocabulary-parallel (its sum reduce-scattered), the LM head
    # column-parallel (its input all-gathered) into the vocabulary-parallel cross-entropy
    vocab = 128256
    embed, head = llama8b.units[0].kind.tp_share(2), llama8b.units[-1].kind.tp_share(2)
    assert embed.params == head.params == vocab * d
    assert embed.scatters == (1, SEQ * d * 2) and embed.gathers == (0, 0) and 0.9 < embed.boundary[1] < 1  # + RoPE
    assert head.gathers == (1, SEQ * d * 2) and head.scatters == (0, 0) and head.boundary[0] == 1
    # a tp rank's ZeRO layout sees the sharded shapes
    shapes = {p.shape for p in llama8b.at_tp(4).units[1].params}
    assert (d // 4, d) in shapes and (d, ffn // 4) in shapes and (d, d) not in shapes


def test_search_prices_tp_and_the_pin_holds(llama8b):
    dev = get_profile("h100")
    kw = dict(gpus=64, global_batch=64, memory_limit=dev.memory_bytes * 0.9)
    free = plan(llama8b, dev, Request(**kw))
    assert {c.layout.tp for c in free.candidates} == {1, 2, 4, 8}
    for tp in (1, 8):  # the search's choice is at least as fast as the best plan at any one tp
        pinned = plan(llama8b, dev, Request(**kw, pin={"tp": tp}))
        assert pinned.chosen is not None and pinned.chosen.layout.tp == tp and pinned.chosen.layout.world == 64
        assert free.chosen.time <= pinned.chosen.time * (1 + 1e-12)
        assert free.chosen.estimate.mfu >= pinned.chosen.estimate.mfu * (1 - 1e-12)
    with pytest.raises(ValueError, match="not the GPU count"):
        Request(**kw, pin={"tp": 8, "pp": 2, "dp": 2, "cp": 1})
    no_tp = plan(llama8b, dev, Request(**kw, allow_tp=False))
    assert all(c.layout.tp == 1 for c in no_tp.candidates)


def test_the_runtime_plan_carries_tp(gpt_cpu):
    profile, dev = gpt_cpu
    res = plan(profile, dev, Request(gpus=4, global_batch=8, memory_limit=2 ** 34, pin={"tp": 2, "pp": 2}))
    p = to_plan(res, res.chosen)
    assert (p.tp, p.pp, p.world_size) == (2, 2, 4)


@pytest.fixture(scope="module")
def gpt_cpu():
    from autopar.examples.gpt import make_gpt

    model, inputs, target, loss = make_gpt(n_layer=4, d_model=32, n_head=2, seq_len=16, batch_size=2)
    return profile_model(model, inputs, target, loss, name="gpt", n_heads=2), get_profile("h100")


def test_tp_is_searched_where_it_shards_a_real_share(llama8b):
    """A dense decoder: the layers' linears, ~all of its FLOPs and parameters: searched at every
    degree. Mixtral: tp shards its attention only (the experts are left to expert parallelism),
    a few percent of its parameters and 14% of its time at 256 tokens: 2 tp ranks would keep at
    best 1 / (2 * 0.86 + 0.14) = 54% of their time useful, under ``TP_EFFICIENCY`` (2/3); tp could
    neither speed a step up nor fit it, and is not searched (``ModelProfile.shards_at``); a
    pinned degree is priced all the same."""
    assert all(llama8b.shards_at(t) for t in (2, 4, 8))
    pm = presets.build_preset("mixtral-8x7b", seq_len=SEQ)
    mixtral = profile_model(pm.model, pm.inputs, pm.target, pm.loss_fn, name=pm.name, layer_repeats=pm.layer_repeats,
                            expert_prefixes=pm.expert_param_prefixes, n_heads=pm.n_heads, n_experts=pm.n_experts,
                            seq_len=SEQ)
    layer = next(u.kind for u in mixtral.units if u.name.startswith("layers."))
    assert layer.tp_share(2) is not None and layer.tp_share(2).params < 0.1 * layer.params  # attention only
    assert not any(mixtral.shards_at(t) for t in (2, 4, 8))
    res = plan(mixtral, get_profile("h100"), Request(gpus=64, global_batch=64, memory_limit=2 ** 36))
    assert {c.layout.tp for c in res.candidates} == {1}
    res = plan(mixtral, get_profile("h100"), Request(gpus=64, global_batch=64, memory_limit=2 ** 36, pin={"tp": 2}))
    assert {c.layout.tp for c in res.candidates} == {2} and res.chosen is not None
