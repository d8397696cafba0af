"""Model presets for the planner: published large-model configs built on the meta device.

``build_preset(name, seq_len, microbatch_size=1, full_depth=False)`` returns a ``PresetModel``:
the model on the meta device in bfloat16 (no storage is allocated, so 671B parameters cost
nothing), one microbatch of example token ids and targets (meta, int64 ``[batch, seq]``), the
loss function, and what the planner needs to scale the captured graph back to the real model.

By default (``full_depth=False``) the built model holds ONE block per distinct block kind and
``layer_repeats`` says how many real layers each one stands for, so that capture stays fast:

* ``gpt3-175b``:    ``{"blocks.0": 96}`` (the ``megatron-*`` GPTs likewise)
* ``llama3-*``:     ``{"layers.0": n_layers}``
* ``mixtral-8x7b``: ``{"layers.0": 32}``
* ``deepseek-v3``:  ``{"layers.0": 3, "layers.1": 58}`` (dense FFN block, MoE block)
* ``glm-5``:        ``{"layers.0": 3, "layers.1": 75}``

With ``full_depth=True`` every layer is built and maps to 1.

The MoE presets are built dropless (``autopar.nn.MoE(capacity_factor=None)``), as DeepSeek-V3
and GLM-5 train: each MoE block's experts are one ``autopar::moe_dispatch`` op in the captured
graph (a fake kernel, no communication at capture) that computes every (token, choice)
assignment, ``top_k`` SwiGLU experts of width ``expert_hidden`` per token. The planner prices it
from that op (``planner.routed.routed_of``, the same path as a user's dropless model): the
token-proportional all-to-alls of the ``tokens * top_k`` routed rows, the experts' FLOPs on
them, and the rows' saved bytes from F until W, at the worst rank's ``--moe-imbalance`` share
(planner/estimate.py). ``PresetModel.moe`` describes that config; the profile checks the capture
against it. Pass ``capacity_factor=`` for a static-capacity MoE (drops overflow; priced by its
``[E, C, d]`` expert buffers; ``moe`` is then None).

Not modelled: DeepSeek-V3's multi-token-prediction module (the 671B figure excludes it; the
14B MTP weights on the hub are extra) and YaRN context extension (RoPE tables are plain).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Callable

import torch
import torch.nn as nn

from autopar.examples.gpt import GPT, GPTConfig, gpt_loss
from autopar.examples.llama import Llama, LlamaConfig, llama_loss

__all__ = ["PresetModel", "names", "build_preset", "parameter_count", "published_parameter_count",
           "active_parameter_count", "published_active_parameter_count"]

DTYPE = torch.bfloat16
PRESET_CAPACITY_FACTOR = None  # dropless (the module docstring)


@dataclass(frozen=True)
class PresetModel:
    name: str
    model: nn.Module              # on meta, bf16
    inputs: tuple                 # one microbatch: (token ids [batch, seq] int64, meta)
    target: torch.Tensor          # meta [batch, seq] int64
    loss_fn: Callable
    layer_repeats: dict           # block path in the built model -> real layers it stands for
    num_layers: int               # real depth
    n_heads: int
    n_kv_heads: int
    expert_param_prefixes: tuple = ()   # substrings naming routed-expert parameters; () if dense
    n_experts: int = 0
    top_k: int = 0
    source: str = ""
    # the dropless MoE config (n_experts, top_k, expert_hidden, d_model, dtype) that
    # ``profile_model(moe=...)`` checks the capture's dispatch ops against (it prices from the
    # ops); None for dense presets and for a static-capacity build (``capacity_factor=``)
    moe: dict | None = None


@dataclass(frozen=True)
class _Spec:
    name: str
    kind: str                     # "gpt" or "llama"
    config: object                # GPTConfig or LlamaConfig at full depth (seq_len = published context)
    source: str
    published_params: float
    published_active: float = 0.0   # parameters one token uses (MoE), as the source states; 0 if not stated


# GPT-3 175B -- Brown et al. 2020, "Language Models are Few-Shot Learners" (arXiv 2005.14165),
# Table 2.1: 96 layers, d_model 12288, 96 heads (d_head 128), context 2048, 175.0B parameters;
# GPT-2 BPE vocabulary of 50257 tokens; learned positions, tied embedding, LayerNorm, GELU MLP 4d.
_GPT3 = _Spec(
    "gpt3-175b", "gpt",
    GPTConfig(vocab_size=50257, seq_len=2048, n_layer=96, n_head=96, d_model=12288),
    "Brown et al. 2020, Language Models are Few-Shot Learners (arXiv:2005.14165), Table 2.1", 175.0e9)

# Megatron-LM's weak-scaling GPT family -- Narayanan et al. 2021, "Efficient Large-Scale Language
# Model Training on GPU Clusters Using Megatron-LM" (arXiv 2104.04473), Table 1: GPT models with
# sequence length 2048 and a vocabulary of 51200 (learned positions, LayerNorm, GELU MLP 4d); the
# four trained with pipeline parallelism (TP 8 x PP 8 / 16 / 35 / 64).
_MEGATRON_SOURCE = ("Narayanan et al. 2021, Efficient Large-Scale Language Model Training on GPU Clusters "
                    "(arXiv:2104.04473), Table 1")


def _megatron(name, n_layer, n_head, d_model, published):
    return _Spec(name, "gpt", GPTConfig(vocab_size=51200, seq_len=2048, n_layer=n_layer, n_head=n_head,
                                        d_model=d_model), _MEGATRON_SOURCE, published)


_MEGATRON_145B = _megatron("megatron-145b", 80, 96, 12288, 145.6e9)
_MEGATRON_310B = _megatron("megatron-310b", 96, 128, 16384, 310.1e9)
_MEGATRON_530B = _megatron("megatron-530b", 105, 128, 20480, 529.6e9)
_MEGATRON_1T = _megatron("megatron-1t", 128, 160, 25600, 1008.0e9)

# Llama 3 -- Llama Team 2024, "The Llama 3 Herd of Models" (arXiv 2407.21783), Table 3, and the
# meta-llama/Meta-Llama-3.1-{8B,70B,405B} config.json / model cards (8.03B, 70.6B, 405.8B):
# vocab 128256, rope_theta 500000, rms_norm_eps 1e-5, 8 KV heads, context 8192 (Llama 3;
# 3.1 extends to 128K with scaled RoPE, which changes no shape).
_LLAMA_SOURCE = ("Llama Team 2024, The Llama 3 Herd of Models (arXiv:2407.21783), Table 3; "
                 "meta-llama/Meta-Llama-3.1-{} config.json")


def _llama3(name, tag, n_layers, d_model, n_heads, ffn_hidden, published):
    cfg = LlamaConfig(vocab_size=128256, d_model=d_model, n_layers=n_layers, n_heads=n_heads, n_kv_heads=8,
                      ffn_hidden=ffn_hidden, seq_len=8192, rope_theta=500000.0, norm_eps=1e-5)
    return _Spec(name, "llama", cfg, _LLAMA_SOURCE.format(tag), published)


_LLAMA3_8B = _llama3("llama3-8b", "8B", 32, 4096, 32, 14336, 8.03e9)
_LLAMA3_70B = _llama3("llama3-70b", "70B", 80, 8192, 64, 28672, 70.6e9)
_LLAMA3_405B = _llama3("llama3-405b", "405B", 126, 16384, 128, 53248, 405.8e9)

# Mixtral 8x7B -- Jiang et al. 2024, "Mixtral of Experts" (arXiv 2401.04088), Table 1, and
# mistralai/Mixtral-8x7B-v0.1 config.json: 32 layers, d 4096, 32 heads / 8 KV heads, 8 experts
# top-2 (softmax, renormalised over the 2), expert hidden 14336, vocab 32000, rope_theta 1e6,
# rms_norm_eps 1e-5, context 32768, router_aux_loss_coef 0.001; 46.7B parameters.
_MIXTRAL = _Spec(
    "mixtral-8x7b", "llama",
    LlamaConfig(vocab_size=32000, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_hidden=14336,
                seq_len=32768, rope_theta=1e6, norm_eps=1e-5,
                n_experts=8, top_k=2, expert_hidden=14336, n_dense_layers=0,
                capacity_factor=PRESET_CAPACITY_FACTOR, aux_loss_weight=0.001, score_func="softmax",
                norm_topk_prob=True),
    "Jiang et al. 2024, Mixtral of Experts (arXiv:2401.04088), Table 1; "
    "mistralai/Mixtral-8x7B-v0.1 config.json", 46.7e9)

# DeepSeek-V3 -- DeepSeek-AI 2024, "DeepSeek-V3 Technical Report" (arXiv 2412.19437), section 4.2,
# and deepseek-ai/DeepSeek-V3 config.json: 61 layers (first 3 dense FFN 18432, then 58 MoE:
# 256 routed experts top-8 + 1 shared, expert hidden 2048, sigmoid scores with a selection-only
# bias, top-8 renormalised and scaled by 2.5, node-limited routing over 8 groups keeping 4),
# d 7168, 128 heads, MLA (q_lora_rank 1536, kv_lora_rank 512, qk_nope 128, qk_rope 64, v 128),
# vocab 129280, rms_norm_eps 1e-6, rope_theta 10000, pre-training context 4096, sequence-wise
# balance loss alpha 1e-4; 671B parameters (without the 14B MTP module).
_DEEPSEEK_V3 = _Spec(
    "deepseek-v3", "llama",
    LlamaConfig(vocab_size=129280, d_model=7168, n_layers=61, n_heads=128, n_kv_heads=128, ffn_hidden=18432,
                seq_len=4096, rope_theta=10000.0, norm_eps=1e-6,
                n_experts=256, top_k=8, expert_hidden=2048, n_shared_experts=1, n_dense_layers=3,
                capacity_factor=PRESET_CAPACITY_FACTOR, aux_loss_weight=1e-4, score_func="sigmoid",
                norm_topk_prob=True, route_scale=2.5, n_expert_groups=8, topk_groups=4, selection_bias=True,
                attention="mla", q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                qk_rope_head_dim=64, v_head_dim=128),
    "DeepSeek-AI 2024, DeepSeek-V3 Technical Report (arXiv:2412.19437), section 4.2; "
    "deepseek-ai/DeepSeek-V3 config.json", 671e9, 37e9)

# GLM-5 -- GLM-5 Team 2026, "GLM-5: from Vibe Coding to Agentic Engineering" (arXiv:2602.15763),
# architecture table (744B total / 40B activated; 3 dense + 75 MoE layers; hidden 6144; dense
# intermediate 12288; MoE intermediate 2048; 256 experts, 8 routed + 1 shared per token; Q LoRA
# 2048, KV LoRA 512; 64 heads; vocabulary 154880), and the zai-org/GLM-5 config as transformers'
# GlmMoeDsaConfig defaults (models/glm_moe_dsa/configuration_glm_moe_dsa.py): 78 layers,
# first_k_dense_replace 3, qk_nope_head_dim 192, qk_rope_head_dim 64, v_head_dim 256,
# num_key_value_heads 64, routed_scaling_factor 2.5, norm_topk_prob, n_group = topk_group = 1,
# rms_norm_eps 1e-5, untied embeddings. Scores: sigmoid with a selection-only correction bias
# (GLM-4.5/DeepSeek-V3 style). Not modelled: the DeepSeek-Sparse-Attention indexer (32 heads of
# 128, about 9M parameters per layer, 0.1% of the total; attention is priced dense) and the MTP
# layer. rope_theta changes no shape (10000 here); context 4096 is this preset's default.
_GLM5 = _Spec(
    "glm-5", "llama",
    LlamaConfig(vocab_size=154880, d_model=6144, n_layers=78, n_heads=64, n_kv_heads=64, ffn_hidden=12288,
                seq_len=4096, rope_theta=10000.0, norm_eps=1e-5,
                n_experts=256, top_k=8, expert_hidden=2048, n_shared_experts=1, n_dense_layers=3,
                capacity_factor=PRESET_CAPACITY_FACTOR, aux_loss_weight=1e-4, score_func="sigmoid",
                norm_topk_prob=True, route_scale=2.5, n_expert_groups=1, topk_groups=1, selection_bias=True,
                attention="mla", q_lora_rank=2048, kv_lora_rank=512, qk_nope_head_dim=192,
                qk_rope_head_dim=64, v_head_dim=256),
    "GLM-5 Team 2026, GLM-5: from Vibe Coding to Agentic Engineering (arXiv:2602.15763), architecture table; "
    "zai-org/GLM-5 config (transformers GlmMoeDsaConfig)", 744e9, 40e9)

_PRESETS: dict[str, _Spec] = {s.name: s for s in (
    _GPT3, _LLAMA3_8B, _LLAMA3_70B, _LLAMA3_405B, _MIXTRAL, _DEEPSEEK_V3, _GLM5, _MEGATRON_145B, _MEGATRON_310B,
    _MEGATRON_530B, _MEGATRON_1T)}

EXPERT_PARAM_PREFIXES = ("feed_forward.experts.",)


def names() -> tuple[str, ...]:
    return tuple(_PRESETS)


def _spec(name: str) -> _Spec:
    try:
        return _PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; known presets: {', '.join(_PRESETS)}") from None


def published_parameter_count(name: str) -> float:
    """The total parameter count the preset's source states."""
    return _spec(name).published_params


def _reduced(spec: _Spec):
    """Config with one block per distinct block kind, and the block path -> real layer count."""
    cfg = spec.config
    if spec.kind == "gpt":
        return replace(cfg, n_layer=1), {"blocks.0": cfg.n_layer}
    dense = cfg.n_dense_layers if cfg.n_experts else cfg.n_layers
    moe = cfg.n_layers - dense
    if dense and moe:
        return replace(cfg, n_layers=2, n_dense_layers=1), {"layers.0": dense, "layers.1": moe}
    return replace(cfg, n_layers=1), {"layers.0": cfg.n_layers}


def build_preset(name: str, seq_len: int, microbatch_size: int = 1, full_depth: bool = False,
                 capacity_factor: float | None = None) -> PresetModel:
    """Build preset ``name`` on the meta device in bf16 with one ``[microbatch_size, seq_len]`` microbatch.

    ``capacity_factor``: None (default) builds the MoE presets dropless; a number builds them
    with that static capacity (``autopar.nn.expert_capacity``). Ignored for dense presets.
    """
    spec = _spec(name)
    if seq_len < 1 or microbatch_size < 1:
        raise ValueError(f"seq_len and microbatch_size must be positive, got {seq_len}, {microbatch_size}")
    if capacity_factor is not None and not capacity_factor > 0:
        raise ValueError(f"capacity_factor must be positive (static capacity) or None (dropless), got "
                         f"{capacity_factor!r}")
    cfg = spec.config
    if spec.kind == "gpt":
        cfg = replace(cfg, seq_len=max(cfg.seq_len, seq_len))  # learned positions: keep the published table
        num_layers, n_heads, n_kv_heads = cfg.n_layer, cfg.n_head, cfg.n_head
        loss_fn = gpt_loss
    else:
        cfg = replace(cfg, seq_len=seq_len)
        if capacity_factor is not None and cfg.n_experts:
            cfg = replace(cfg, capacity_factor=capacity_factor)
        num_layers, n_heads, n_kv_heads = cfg.n_layers, cfg.n_heads, cfg.n_kv_heads
        loss_fn = llama_loss
    if full_depth:
        repeats = {f"{'blocks' if spec.kind == 'gpt' else 'layers'}.{i}": 1 for i in range(num_layers)}
    else:
        cfg, repeats = _reduced(replace(spec, config=cfg))
    with torch.device("meta"):
        model = (GPT(cfg) if spec.kind == "gpt" else Llama(cfg)).to(DTYPE)
        tokens = torch.empty(microbatch_size, seq_len, dtype=torch.long)
        target = torch.empty(microbatch_size, seq_len, dtype=torch.long)
    is_moe = spec.kind == "llama" and spec.config.n_experts > 0
    moe = None
    if is_moe and capacity_factor is None:
        moe = {"n_experts": cfg.n_experts, "top_k": cfg.top_k, "expert_hidden": cfg.expert_hidden,
               "d_model": cfg.d_model, "dtype": DTYPE}
    return PresetModel(
        name=name, model=model, inputs=(tokens,), target=target, loss_fn=loss_fn,
        layer_repeats=repeats, num_layers=num_layers, n_heads=n_heads, n_kv_heads=n_kv_heads,
        expert_param_prefixes=EXPERT_PARAM_PREFIXES if is_moe else (),
        n_experts=spec.config.n_experts if is_moe else 0, top_k=spec.config.top_k if is_moe else 0,
        source=spec.source, moe=moe)


# parameter counts do not depend on the capacity: the counts build the static form, which
# skips the dropless registration's per-block probe (about 1 s per 256-expert block)
_COUNTING = 1.0


def published_active_parameter_count(name: str) -> float:
    """The activated (per-token) parameter count the source states (0 for dense presets)."""
    return _spec(name).published_active


@functools.lru_cache(maxsize=None)
def active_parameter_count(name: str) -> int:
    """Parameters one token computes with in the full-depth model: everything but the routed
    experts and the input embedding table (a lookup), plus top_k / n_experts of the routed
    experts (GLM-5's 40B and DeepSeek-V3's 37B count this way: 40.1B and 36.6B here)."""
    spec = _spec(name)
    preset = build_preset(name, seq_len=spec.config.seq_len, full_depth=True, capacity_factor=_COUNTING)
    total = experts = 0
    embedding = preset.model.get_submodule("tok_embeddings").weight
    for fqn, p in preset.model.named_parameters():
        if p is not embedding:
            total += p.numel()
        if any(x in fqn for x in preset.expert_param_prefixes):
            experts += p.numel()
    if not preset.n_experts:
        return total
    return total - experts + experts * preset.top_k // preset.n_experts


@functools.lru_cache(maxsize=None)
def parameter_count(name: str) -> int:
    """Total parameters of the full-depth model (built on meta at the published context; tied weights once)."""
    spec = _spec(name)
    preset = build_preset(name, seq_len=spec.config.seq_len, full_depth=True, capacity_factor=_COUNTING)
    return sum(p.numel() for p in preset.model.parameters())
