"""Tiny Hugging Face ``transformers`` models for the tests, built from configs in the test (no
download, no weights from a hub): the architectures autopar is tested on, per axis.

``make_hf(name, seed=0, batch=8, seq=16) -> ModelCase`` builds the model under
``torch.manual_seed(seed)`` with ``attn_implementation`` as each family runs by default
(SDPA, or eager for Gemma2's soft-capped attention), fp32, dropout off, and a batch of token
ids; ``loss_fn`` is next-token cross entropy on the logits (``hf_lm_loss``), or the masked
token loss for the encoder. ``HF_NAMES`` lists the cases; ``HF_DECODERS`` the causal LMs with
RoPE (the CP cases); ``HF_MOE`` the mixture-of-experts ones (the EP cases); ``HF_SINKS`` eager
attention with learned per-head sink logits (GPT-OSS, eager; also MoE), not in ``HF_NAMES``;
``HF_GROUPED`` MoE whose experts take rows grouped by expert (Llama 4) and ``HF_GLM`` the
GLM-4.5-style MoE, not in ``HF_NAMES``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tests.models import ModelCase

VOCAB = 128
HF_DECODERS = ("llama", "qwen2", "mistral", "gemma2")
HF_MOE = ("mixtral", "qwen3_moe", "deepseek_v3")
HF_NAMES = ("gpt2",) + HF_DECODERS + HF_MOE + ("bert",)
HF_SEQ2SEQ = ("t5",)  # encoder-decoder: batches from seq2seq_batch, not in HF_NAMES
HF_SINKS = ("gpt_oss",)  # eager attention with learned per-head sink logits (also MoE, alternating sliding windows)
# MoE whose experts take one tensor of rows grouped by expert (Llama 4: every expert gets every token,
# scaled by its router score; top-1 sigmoid routing, a shared expert, chunked attention, NoPE layers)
HF_GROUPED = ("llama4",)
# GLM-4.5-style MoE (sigmoid routing with a selection bias, shared expert, first layer dense): EP only
HF_GLM = ("glm4_moe",)


def _common(**kw) -> dict:
    base = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
    base.update(kw)
    return base


def _config(name: str):
    import transformers as tf

    if name == "gpt2":
        return tf.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0,
                             bos_token_id=0, eos_token_id=0,
                             embd_pdrop=0.0, attn_pdrop=0.0)
    if name == "llama":
        return tf.LlamaConfig(**_common())
    if name == "qwen2":
        return tf.Qwen2Config(**_common())
    if name == "mistral":
        return tf.MistralConfig(**_common(sliding_window=8))
    if name == "gemma2":
        return tf.Gemma2Config(**_common(head_dim=8, sliding_window=8, attn_logit_softcapping=50.0,
                                         final_logit_softcapping=30.0, query_pre_attn_scalar=8))
    if name == "mixtral":
        return tf.MixtralConfig(**_common(num_local_experts=4, num_experts_per_tok=2))
    if name == "qwen3_moe":
        return tf.Qwen3MoeConfig(**_common(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                           head_dim=8, norm_topk_prob=True))
    if name == "deepseek_v3":
        return tf.DeepseekV3Config(**_common(
            n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1, n_group=2,
            topk_group=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=4,
            qk_nope_head_dim=4, v_head_dim=8, num_key_value_heads=4, routed_scaling_factor=2.5))
    if name == "gpt_oss":
        return tf.GptOssConfig(**_common(intermediate_size=32, head_dim=8, num_local_experts=4, num_experts_per_tok=2,
                                         sliding_window=8, rope_parameters={"rope_type": "default", "rope_theta": 1e4}))
    if name == "gemma3":  # 5 sliding-window layers per global one, local and global RoPE, qk norms
        return tf.Gemma3TextConfig(**_common(head_dim=8, sliding_window=8, query_pre_attn_scalar=8,
                                             layer_types=["sliding_attention", "full_attention"]))
    if name == "glm4_moe":
        return tf.Glm4MoeConfig(**_common(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                          n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
                                          head_dim=8, routed_scaling_factor=2.5))
    if name == "llama4":
        return tf.Llama4TextConfig(**_common(intermediate_size=32, intermediate_size_mlp=64, head_dim=8,
                                             num_local_experts=4, num_experts_per_tok=1, interleave_moe_layer_step=1,
                                             attention_chunk_size=8, no_rope_layers=[1, 0], use_qk_norm=True))
    if name == "bert":
        return tf.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                             intermediate_size=64, max_position_embeddings=64, hidden_dropout_prob=0.0,
                             attention_probs_dropout_prob=0.0)
    if name == "t5":  # relative position bias (a learned SDPA mask), cross-attention
        return tf.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
                           num_heads=4, dropout_rate=0.0, relative_attention_num_buckets=8,
                           decoder_start_token_id=0, pad_token_id=0)
    raise KeyError(name)


def hf_lm_loss(out, target: torch.Tensor) -> torch.Tensor:
    """Cross entropy of every position's logits against its target token, in fp32."""
    logits = out.logits if hasattr(out, "logits") else out["logits"] if isinstance(out, dict) else out
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), target.reshape(-1))


def build_hf(name: str, seed: int = 0, use_cache: bool = True):
    """The model alone (eval-free: train mode, dropout probabilities 0). ``use_cache=False`` is
    what training scripts set (Trainer, gradient checkpointing): transformers then builds its
    masks without a cache object, on other graph paths."""
    import transformers as tf

    cfg = _config(name)
    cfg.use_cache = use_cache
    cfg.attn_implementation = "eager" if name in ("gemma2", "gpt_oss") else "sdpa"
    torch.manual_seed(seed)
    cls = {"bert": tf.BertForMaskedLM, "llama4": tf.Llama4ForCausalLM}.get(name, tf.AutoModelForCausalLM)
    if name in HF_SEQ2SEQ:
        cls = tf.AutoModelForSeq2SeqLM
    model = cls(cfg) if name in ("bert", "llama4") else cls.from_config(cfg)
    model.train()
    return model


def make_hf(name: str, seed: int = 0, batch: int = 8, seq: int = 16, use_cache: bool = True) -> ModelCase:
    model = build_hf(name, seed, use_cache=use_cache)
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, VOCAB, (batch, seq), generator=g)
    target = torch.randint(0, VOCAB, (batch, seq), generator=g)
    return ModelCase(name=f"hf_{name}", model=model, inputs=(ids,), target=target, loss_fn=hf_lm_loss)


def seq2seq_batch(case: ModelCase) -> dict:
    """An encoder-decoder batch of a make_hf case: the tokens as ``input_ids`` (every other row
    left-padded by ``attention_mask``), its target as ``labels`` (the model's own loss) and,
    shifted right behind the decoder start token 0, as ``decoder_input_ids``."""
    ids, labels = case.inputs[0], case.target
    mask = torch.ones_like(ids)
    mask[::2, :3] = 0
    decoder_ids = torch.cat([torch.zeros_like(labels[:, :1]), labels[:, :-1]], dim=1)
    return {"input_ids": ids, "attention_mask": mask, "decoder_input_ids": decoder_ids, "labels": labels}


def mixtral_for_plan():
    """``autopar plan --model tests.hf_models:mixtral_for_plan``: a tiny HF Mixtral, batch 8 x 16
    tokens (the request tests/unit/test_hf_planner.py also gives ``parallelize``)."""
    case = make_hf("mixtral", batch=8, seq=16)
    return case.model, case.inputs, case.target, case.loss_fn
