"""H5: parallelize without a plan considers cp for an HF Llama and ep for an HF Mixtral: the
planner step of autopar/build.py (choose_plan, for a world of 4) prices layouts with cp > 1
(the context-parallel pass accepts Llama's masks) and names them in its log; for Mixtral it
enumerates ep > 1 (its experts are recognized), tp > 1 and experts folded over tp (ep up to
dp x cp x tp), the same layouts ``autopar plan --model`` enumerates (F4)."""
import logging

import pytest

from autopar.build import choose_plan
from tests.hf_models import make_hf


@pytest.mark.parametrize("name, axis", [("llama", "cp")])  # ep: test_parallelize_and_autopar_plan_...
def test_planner_considers_the_axis(name, axis, caplog):
    case = make_hf(name, batch=8, seq=16)
    with caplog.at_level(logging.INFO, logger="autopar"):
        plan, _summary = choose_plan(model=case.model, inputs=case.inputs, target=case.target, loss_fn=case.loss_fn,
                                     batch=8, world=4)
    wanted = "layouts with cp=2 ep=1" if axis == "cp" else "layouts with cp=1 ep=2"
    lines = [r.getMessage() for r in caplog.records if wanted in r.getMessage()]
    assert lines, [r.getMessage() for r in caplog.records][-10:]
    assert plan.world_size == 4


def test_parallelize_and_autopar_plan_search_the_same_layouts(monkeypatch, caplog):
    """F4: for the same request (a tiny HF Mixtral, 4 devices of this machine's profile, global
    batch 8), ``parallelize`` without a plan (autopar/build.py's choose_plan) and ``autopar plan
    --model`` enumerate the same layouts, tensor-parallel and expert-parallel ones included, and
    the log names the axes searched. (The tiny model's experts are most
    of its time, so tp is judged not worth searching at its efficiency threshold: lowered here,
    for both.)"""
    from autopar.planner import cli, profile, search

    monkeypatch.setattr(profile, "TP_EFFICIENCY", 0.0)

    enumerated = []
    real = search.plan

    def recording(profile, device, req, progress=None):
        max_tp = min(search.TP_DEGREES[-1], device.gpus_per_node)
        enumerated.append(set(search.layouts(profile, req, lambda lay, why: None, max_tp=max_tp)))
        return real(profile, device, req, progress)

    monkeypatch.setattr(search, "plan", recording)
    case = make_hf("mixtral", batch=8, seq=16)
    with caplog.at_level(logging.INFO, logger="autopar"):
        choose_plan(model=case.model, inputs=case.inputs, target=case.target, loss_fn=case.loss_fn, batch=8, world=4)
    assert cli.main(["--model", "tests.hf_models:mixtral_for_plan", "--gpus", "4", "--global-batch", "8",
                     "--device", "cpu", "--json", "--quiet"]) == 0
    ours, theirs = enumerated
    assert ours == theirs
    assert {(lay.tp, lay.ep) for lay in ours} >= {(1, 1), (2, 1), (1, 2), (2, 2), (4, 1)}, sorted(
        {(lay.tp, lay.ep) for lay in ours})
    # experts folded over the tp ranks: ep beyond dp x cp (4 over dp=2 x tp=2; 4 over tp=4; 2 over
    # pp=2 x tp=2 with dp=1), in both searches alike
    folded = {(lay.tp, lay.dp, lay.cp, lay.ep) for lay in ours if lay.ep > lay.dp * lay.cp}
    assert folded >= {(2, 2, 1, 4), (4, 1, 1, 4), (2, 1, 1, 2)}, sorted(folded)
    said = [r.getMessage() for r in caplog.records if "autopar planner: searched tp 1,2,4;" in r.getMessage()]
    assert said and "ep 1,2,4" in said[0], [r.getMessage() for r in caplog.records][-10:]


def test_user_dropless_moe_priced_from_its_dispatch_ops():
    """A user's model with dropless ``autopar.nn.MoE`` blocks (real CPU tensors, as
    ``parallelize`` profiles it) goes the presets' path: each MoE unit's routed rows are read off
    its ``autopar::moe_dispatch`` op (N tokens x top_k, hand-derived), and the EP all-to-alls and
    the worst rank's memory are priced from them."""
    import torch

    from autopar.examples.llama import LlamaConfig, make_llama
    from autopar.planner.comm import all_to_all_time
    from autopar.planner.devices import get_profile
    from autopar.planner.estimate import Evaluator, Layout
    from autopar.planner.profile import profile_model

    batch, seq, d, h, k = 4, 16, 32, 48, 2
    cfg = LlamaConfig(vocab_size=64, d_model=d, n_layers=2, n_heads=2, n_kv_heads=2, ffn_hidden=64, seq_len=seq,
                      n_experts=4, top_k=k, expert_hidden=h, capacity_factor=None)
    model, inputs, target, loss_fn = make_llama(cfg, batch_size=batch)
    prof = profile_model(model, inputs, target, loss_fn, expert_prefixes=(".experts.",), n_experts=4)
    ops = [n for n in prof.captured.gm.graph.nodes if n.target is torch.ops.autopar.moe_dispatch.default]
    assert len(ops) == 2
    moes = [u.kind for u in prof.units if u.kind.expert_params]
    assert len(moes) == 2 and all(u.kind.routed is None for u in prof.units if not u.kind.expert_params)
    r = moes[0].routed
    assert (r.rows, r.row_bytes, r.flops_per_row, r.dtype) == (batch * seq * k, d * 4, 6 * d * h, "float32")
    # the experts' weights the programs move (4 SwiGLU experts: three [d, h] fp32 matrices each):
    # F and I read them once (the forward GEMMs, the input-gradient GEMMs), W reads them (its
    # re-walk) and writes their gradients; a rank of an ep group moves 1/ep of them
    weights = 4 * 3 * d * h * 4
    assert [sum(p.expert_bytes) for p in (moes[0].f, moes[0].i, moes[0].w)] == [weights, weights, 2 * weights]
    dev = get_profile("h100")
    ev = Evaluator(prof, dev, 80e9, 8)
    one, two = (Layout(1, 2, 1, ep, "1f1b", 1, 1, batch, 0) for ep in (1, 2))
    f1, i1, w1 = ev.unit_times(moes[0], one)
    f2, i2, w2 = ev.unit_times(moes[0], two)
    imb = ev.moe_imbalance
    a2a = 2 * all_to_all_time(r.rows * imb * r.row_bytes, 2, ev.links(two)["ep"])
    extra = (imb - 1) * r.rows * r.flops_per_row / dev.flops_rate("float32")

    def fewer(k, ep):  # the programs' time saved by moving 1/ep of the expert weights
        return [k.time_scale * (p.time(dev, 1.0, ep) - p.time(dev, 1.0, 1)) for p in (k.f, k.i, k.w)]

    assert f2 - f1 == pytest.approx(a2a + extra + fewer(moes[0], 2)[0], rel=1e-9)
    assert w2 - w1 == pytest.approx(extra + fewer(moes[0], 2)[2], rel=1e-9)
    # the routed state is held from F to W: the mean in the unit's saved bytes, the worst rank's above it
    (a1, b1), (a2, b2) = ev.unit_saved(moes[0], one), ev.unit_saved(moes[0], two)
    assert a1 >= r.rows * r.saved_row_bytes and b1 >= r.rows * (r.saved_row_bytes + r.row_bytes)
    assert a2 - a1 == pytest.approx((imb - 1) * r.rows * r.saved_row_bytes, rel=1e-9) and b2 - b1 == a2 - a1
    # experts folded over tp=2 (ep=4 over dp=2 x tp=2): against tp=2 without ep, each tp rank
    # routes half the rows (its experts' GEMMs halve: F and I by half the rows' FLOPs, W by 3/2 of
    # that), sends half through the all-to-alls, and all-gathers the [N, d] outputs over tp in F
    # and their gradients in I; it keeps half the routed state, at the worst rank's imbalance
    ev2 = ev.for_tp(2)
    kind = next(u.kind for u in ev2.units if u.kind.expert_params)
    rt = kind.routed
    assert rt.token_bytes == batch * seq * d * 4  # the unit's one block: [N, d] fp32
    plain, folded = (Layout(1, 2, 1, ep, "1f1b", 1, 1, batch, 0, tp=2) for ep in (1, 4))
    wide = Layout(1, 4, 1, 2, "1f1b", 1, 1, batch, 0, tp=2)  # ep=2 over dp=4 x tp=2: 4 copies of each expert
    assert (ev2.expert_replicas(folded), ev2.expert_replicas(wide)) == (1, 4)
    links = ev2.links(folded)
    rate = dev.flops_rate("float32")
    half = rt.rows / 2 * rt.flops_per_row / rate
    gather = ev2.collective("all_gather", rt.token_bytes, 2, links["tp"])
    a2a = 2 * all_to_all_time(rt.rows / 2 * imb * rt.row_bytes, 4, links["ep"])
    extra = (imb - 1) * rt.rows / 2 * rt.flops_per_row / rate
    (fp, ip, wp), (ff, fi, fw) = ev2.unit_times(kind, plain), ev2.unit_times(kind, folded)
    df, di, dw = fewer(kind, 4)
    assert ff - fp == pytest.approx(-half + gather + a2a + extra + df, rel=1e-9)
    assert fi - ip == pytest.approx(-half + gather + a2a + extra + di, rel=1e-9)
    assert fw - wp == pytest.approx(-1.5 * half + extra + dw, rel=1e-9)
    (sp, _), (sf, _) = ev2.unit_saved(kind, plain), ev2.unit_saved(kind, folded)
    assert sf - sp == pytest.approx((imb - 1) * rt.rows / 2 * rt.saved_row_bytes, rel=1e-9)


def test_hf_moe_captured_through_the_dispatch_op():
    """The planner captures a Hugging Face MoE model with its experts as the dispatch op EP runs
    (``expert_parallel.dispatch_form``, ep = 1): same outputs as the model's own grouped_mm experts, routed
    rows N x k per block, and the model left as it was."""
    import torch

    from autopar.passes.expert_parallel import dispatch_form
    from autopar.planner.profile import profile_model

    case = make_hf("mixtral", batch=2, seq=8)
    model = case.model
    experts = [m for n, m in model.named_modules() if n.endswith("mlp.experts")]
    assert experts
    cls = [type(e) for e in experts]
    with torch.no_grad():
        ref = model(*case.inputs).logits
        with dispatch_form(model):
            assert all(type(e) is not c for e, c in zip(experts, cls))
            out = model(*case.inputs).logits
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    assert [type(e) for e in experts] == cls and not any(hasattr(e, "ep") for e in experts)
    prof = profile_model(model, case.inputs, case.target, case.loss_fn, expert_prefixes=("experts",))
    moes = [u.kind for u in prof.units if u.kind.expert_params]
    k = model.config.num_experts_per_tok
    assert len(moes) == model.config.num_hidden_layers
    assert all(m.routed is not None and m.routed.rows == 2 * 8 * k for m in moes)
    assert moes[0].routed.row_bytes == model.config.hidden_size * 4
    assert [type(e) for e in experts] == cls


def _write_config(tmp_path, name, **overrides):
    """tests/hf_models' tiny config of ``name`` as the config.json a user has (model_type included)."""
    import json

    from tests.hf_models import _config

    data = _config(name).to_dict()
    data.update(overrides)
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(data))
    return path


def test_plan_from_a_config_json(tmp_path, capsys):
    """autopar plan --hf-config: a DeepSeek-V3-style config of 5 layers whose first 2 are dense
    (first_k_dense_replace) is built with 3 (two dense layers standing for one each, one MoE
    layer standing for 3); the planner's parameter count equals the full model's, built from
    the same config on the meta device and counted here; ep layouts are priced; a Gemma2 config's
    alternating sliding/full layers are two kinds even with equal parameters."""
    import json

    import torch
    import transformers

    from autopar.planner import cli
    from autopar.planner.hf_config import build_from_config, load_config

    path = _write_config(tmp_path, "deepseek_v3", num_hidden_layers=5, first_k_dense_replace=2)
    hm = build_from_config(str(path), seq_len=16)
    assert hm.layer_repeats == {"model.layers.0": 1, "model.layers.1": 1, "model.layers.2": 3}
    assert len(hm.model.model.layers) == 3 and hm.n_experts == 4
    with torch.device("meta"):
        full = transformers.AutoModelForCausalLM.from_config(load_config(str(path)))
    want = sum(p.numel() for p in full.parameters())
    assert cli.main(["--hf-config", str(path), "--gpus", "4", "--global-batch", "8", "--seq", "16", "--json",
                     "--quiet", "--device", "h100"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["parameters"] == want, (out["parameters"], want)
    assert any(a.get("ep", 1) > 1 for a in out["alternatives"]), out["alternatives"]  # EP layouts priced
    types = ["sliding_attention", "full_attention"] * 3
    gemma = build_from_config(str(_write_config(tmp_path, "gemma2", num_hidden_layers=6, layer_types=types)),
                              seq_len=16)
    assert len(gemma.model.model.layers) == 2 and gemma.model.config.layer_types == types[:2]
    assert gemma.layer_repeats == {"model.layers.0": 3, "model.layers.1": 3}
    with pytest.raises(ValueError, match="no such file"):
        build_from_config(str(tmp_path / "missing.json"), seq_len=16)


def _llama_params(c) -> int:
    """A Llama config's parameter count by hand: embeddings, per layer q/k/v/o, SwiGLU, two
    RMSNorms, the final norm and an untied head."""
    d, hd = c["hidden_size"], c["hidden_size"] // c["num_attention_heads"]
    attn = d * c["num_attention_heads"] * hd * 2 + 2 * d * c["num_key_value_heads"] * hd
    layer = attn + 3 * d * c["intermediate_size"] + 2 * d
    return 2 * c["vocab_size"] * d + c["num_hidden_layers"] * layer + d


def _qwen3_moe_params(c) -> int:
    """A Qwen3-MoE config's by hand: q/k/v/o with per-head q and k norms, a router, E SwiGLU
    experts of moe_intermediate_size, two RMSNorms a layer, final norm, untied head."""
    d, hd, e = c["hidden_size"], c["head_dim"], c["num_experts"]
    attn = d * c["num_attention_heads"] * hd * 2 + 2 * d * c["num_key_value_heads"] * hd + 2 * hd
    layer = attn + e * d + e * 3 * d * c["moe_intermediate_size"] + 2 * d
    return 2 * c["vocab_size"] * d + c["num_hidden_layers"] * layer + d


def test_plan_model_from_dense_and_moe_configs_written_here(tmp_path):
    """P3: plan_model(hf_config=...) on a Llama-like dense config and a Qwen3-MoE-like config
    written by this test: the report names the architecture and a parameter count equal to the
    config's own arithmetic (by hand above); the MoE one prices EP layouts; a config
    transformers cannot build is one line naming why."""
    import json

    from autopar.planner import plan_model
    from autopar.planner.devices import get_profile

    dense = dict(model_type="llama", hidden_size=64, intermediate_size=160, num_hidden_layers=12,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=256, max_position_embeddings=128,
                 tie_word_embeddings=False)
    moe = dict(model_type="qwen3_moe", hidden_size=64, intermediate_size=160, moe_intermediate_size=32,
               num_hidden_layers=10, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
               num_experts_per_tok=2, vocab_size=256, max_position_embeddings=128, tie_word_embeddings=False,
               decoder_sparse_step=1, mlp_only_layers=[])
    for cfg, count in ((dense, _llama_params), (moe, _qwen3_moe_params)):
        path = tmp_path / f"{cfg['model_type']}.json"
        path.write_text(json.dumps(cfg))
        res, info = plan_model(hf_config=str(path), gpus=8, global_batch=16, seq_len=32, device=get_profile("h100"))
        assert info["parameters"] == count(cfg), (cfg["model_type"], info["parameters"], count(cfg))
        assert res.evaluator.profile.name.startswith("LlamaForCausalLM" if cfg is dense else "Qwen3MoeForCausalLM")
        assert res.chosen is not None
        if cfg is moe:
            assert any(c.layout.ep > 1 for c in res.candidates if c.estimate is not None)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(dict(dense, num_attention_heads=5)))  # 64 not divisible by 5 heads
    with pytest.raises(ValueError) as err:
        plan_model(hf_config=str(bad), gpus=8, global_batch=16, seq_len=32, device=get_profile("h100"))
    assert "\n" not in str(err.value) and "--hf-config" in str(err.value), str(err.value)


@pytest.mark.parametrize("preset,gpus,batch,seq", [("llama3-8b", 16, 64, 4096)])
def test_config_with_a_presets_numbers_gets_its_plan(tmp_path, preset, gpus, batch, seq):
    """Issue 34 P3: a Hugging Face Llama config.json written from a preset's own numbers
    (planner/presets.py) is planned to the preset's layout (degrees, schedule, microbatches,
    ZeRO): transformers' graph and autopar's Llama price the same per layer (its causal mask
    becomes SDPA's is_causal, passes/causal_mask.py; both run grouped-query SDPA), and the
    predicted step agrees within 3%."""
    import json

    from autopar.planner import plan_model, presets
    from autopar.planner.presets import _spec

    c = _spec(preset).config
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": c.d_model,
           "intermediate_size": c.ffn_hidden, "num_hidden_layers": c.n_layers, "num_attention_heads": c.n_heads,
           "num_key_value_heads": c.n_kv_heads, "vocab_size": c.vocab_size, "rope_theta": c.rope_theta,
           "max_position_embeddings": c.seq_len, "rms_norm_eps": c.norm_eps, "tie_word_embeddings": False,
           "hidden_act": "silu", "torch_dtype": "bfloat16"}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    from autopar.planner.devices import get_profile

    dev = get_profile("h100")
    hf, _ = plan_model(hf_config=str(path), gpus=gpus, global_batch=batch, seq_len=seq, device=dev)
    pm = presets.build_preset(preset, seq_len=seq)
    own, _ = plan_model(pm.model, pm.inputs, pm.target, pm.loss_fn, gpus=gpus, global_batch=batch, device=dev,
                        name=pm.name, layer_repeats=pm.layer_repeats, n_heads=pm.n_heads, seq_len=seq)

    def layout(res):
        lay = res.chosen.layout
        return lay.pp, lay.dp, lay.cp, lay.ep, lay.schedule, lay.m, lay.b, lay.zero
    assert layout(hf) == layout(own), (layout(hf), layout(own))
    assert hf.chosen.time == pytest.approx(own.chosen.time, rel=0.03)


def test_grouped_experts_config_is_priced_as_its_static_form(tmp_path):
    """A Llama-4-like config (experts given every token grouped by expert, passes/grouped_experts.py),
    written as the published ones are: a multimodal ``Llama4Config`` whose ``text_config`` holds
    the language model, which is what gets planned (the vision tower is left out). The planner
    searches EP for it and prices its all-to-all volume as the static groups, E experts x N
    tokens x d per MoE layer and microbatch (hand count: 4 x 32 x 64 bf16), and the expert
    weights split over ep."""
    import json

    from autopar.planner import plan_model
    from autopar.planner.devices import get_profile

    text = dict(model_type="llama4_text", hidden_size=64, intermediate_size=32, intermediate_size_mlp=96,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                num_experts_per_tok=1, interleave_moe_layer_step=1, vocab_size=256, max_position_embeddings=128,
                attention_chunk_size=32, tie_word_embeddings=False, torch_dtype="bfloat16")
    cfg = dict(model_type="llama4", architectures=["Llama4ForConditionalGeneration"], text_config=text,
               torch_dtype="bfloat16")
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    res, _info = plan_model(hf_config=str(path), gpus=4, global_batch=8, seq_len=32, device=get_profile("h100"),
                            pin={"ep": 2, "dp": 4})
    prof = res.evaluator.profile
    assert prof.name.startswith("Llama4ForCausalLM"), prof.name  # the language model of the multimodal config
    moe = [k for k in prof.kinds if k.expert_params]
    assert moe, [k.kind for k in prof.kinds]
    tokens = prof.batch0 * 32
    for k in moe:
        assert k.routed is None and k.dispatch_bytes == 4 * tokens * 64 * 2, (k.kind, k.dispatch_bytes)
        assert k.expert_params == 4 * (64 * 2 * 32 + 32 * 64), k.expert_params
    assert res.chosen is not None and res.chosen.layout.ep == 2


def test_expert_all_to_all_prices_its_intra_and_inter_node_parts():
    """An ep group over 8-GPU nodes: of 64 members 8 share a node (7/64 of the bytes over
    NVLink, 56/64 over the NICs, at once: the slower bounds it); 8 members on one node: all
    NVLink; members 8 apart: one per node, all NICs. Hand-derived from the h100 profile's links."""
    from autopar.planner.comm import group_all_to_all_time
    from autopar.planner.devices import get_profile

    dev = get_profile("h100")
    a, b = dev.intra, dev.inter
    nbytes = 3e8
    far = 56 * b.alpha_s + 56 / 64 * nbytes / b.bandwidth
    near = 7 * a.alpha_s + 7 / 64 * nbytes / a.bandwidth
    assert group_all_to_all_time(dev, nbytes, 64, 1) == pytest.approx(max(near, far), rel=1e-12)
    assert group_all_to_all_time(dev, nbytes, 8, 1) == pytest.approx(7 * a.alpha_s + 7 / 8 * nbytes / a.bandwidth)
    assert group_all_to_all_time(dev, nbytes, 8, 8) == pytest.approx(7 * b.alpha_s + 7 / 8 * nbytes / b.bandwidth)
    assert group_all_to_all_time(dev, nbytes, 1, 1) == 0.0
