"""Layers autopar knows how to parallelize beyond pipeline and data parallelism.

``MoE`` is a static-shape, capacity-based token-choice top-k Mixture-of-Experts block
(``forward(x[..., d]) -> (y[..., d], aux_loss)``; add ``aux_loss`` into the model's loss).
Every shape depends on the input shape only, so ``torch.export`` captures it as one graph and
``autopar.passes.expert_parallel.apply_expert_parallel`` can spread its experts over ranks.
Use it in place of data-dependent MoE blocks (Hugging Face Mixtral / Qwen-MoE style, with an
``nn.ModuleList`` of experts), which autopar cannot capture statically or shard.

``GroupedExperts`` holds the ``E`` experts' SwiGLU weights batched (``w1, w3 [E, d, h]``,
``w2 [E, h, d]``); ``SwiGLU`` is the plain FFN used for shared experts.

The implementation lives in ``autopar.examples.moe`` (importable without autopar).
"""
from autopar.examples.moe import GroupedExperts, MoE, SwiGLU, expert_capacity

__all__ = ["MoE", "GroupedExperts", "SwiGLU", "expert_capacity"]
