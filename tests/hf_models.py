"""Tiny Hugging Face ``transformers`` models for the tests, built from configs in the test (no
download, no weights from a hub): the architectures autopar is tested on, per axis.

``make_hf(name, seed=0, batch=8, seq=16) -> ModelCase`` builds the model under
``torch.manual_seed(seed)`` with ``attn_implementation`` as each family runs by default
(SDPA, or eager for Gemma2's soft-capped attention), fp32, dropout off, and a batch of token
ids; ``loss_fn`` is next-token cross entropy on the logits (``hf_lm_loss``), or the masked
token loss for the encoder. ``HF_NAMES`` lists the cases; ``HF_DECODERS`` the causal LMs with
RoPE (the CP cases); ``HF_MOE`` the mixture-of-experts ones (the EP cases).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tests.models import ModelCase

VOCAB = 128
HF_DECODERS = ("llama", "qwen2", "mistral", "gemma2")
HF_MOE = ("mixtral", "qwen3_moe", "deepseek_v3")
HF_NAMES = ("gpt2",) + HF_DECODERS + HF_MOE + ("bert",)


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
    if name == "bert":
        return tf.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                             intermediate_size=64, max_position_embeddings=64, hidden_dropout_prob=0.0,
                             attention_probs_dropout_prob=0.0)
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
    cfg.attn_implementation = "eager" if name == "gemma2" else "sdpa"
    torch.manual_seed(seed)
    cls = tf.BertForMaskedLM if name == "bert" else tf.AutoModelForCausalLM
    model = cls(cfg) if name == "bert" else cls.from_config(cfg)
    model.train()
    return model


def make_hf(name: str, seed: int = 0, batch: int = 8, seq: int = 16, use_cache: bool = True) -> ModelCase:
    model = build_hf(name, seed, use_cache=use_cache)
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, VOCAB, (batch, seq), generator=g)
    target = torch.randint(0, VOCAB, (batch, seq), generator=g)
    return ModelCase(name=f"hf_{name}", model=model, inputs=(ids,), target=target, loss_fn=hf_lm_loss)
