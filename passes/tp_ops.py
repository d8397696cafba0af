"""The tensor-parallel graph ops: ``autopar::tp_reduce``, ``tp_copy``, the vocabulary-parallel
cross-entropy and its backward (inserted by passes/tensor_parallel.py), the token-sharding
``sp_all_gather``, ``sp_reduce_scatter``, ``sp_gather`` and ``sp_split`` (inserted by
passes/sequence_parallel.py; the last two also split an MoE block's tokens over the tp ranks
when its experts are folded over them, passes/moe_dispatch.py): schemas, fake kernels and
autograd formulas, with eager kernels whose collectives go through collectives/comms.py."""
from __future__ import annotations

import torch

from autopar import linear_ce
from autopar.collectives import comms

# -- the collectives (differentiable graph ops) ---------------------------------------------------------------------


@torch.library.custom_op("autopar::tp_reduce", mutates_args=())
def tp_reduce(x: torch.Tensor, group: str) -> torch.Tensor:
    """Forward: the sum over the tp group (a row linear's partial products); backward: identity."""
    return comms.summed(x, group)


@tp_reduce.register_fake
def _(x, group):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


tp_reduce.register_autograd(lambda ctx, grad: (grad, None))
REDUCE = torch.ops.autopar.tp_reduce.default


@torch.library.custom_op("autopar::tp_copy", mutates_args=())
def tp_copy(x: torch.Tensor, group: str) -> torch.Tensor:
    """Forward: identity (a replicated value entering the tp region); backward: the sum over the
    tp group of the input's gradient (each rank's holds its shard's part only)."""
    return x.clone()


@tp_copy.register_fake
def _(x, group):
    return torch.empty_like(x)


def _copy_setup(ctx, inputs, output):
    ctx.group = inputs[1]


tp_copy.register_autograd(lambda ctx, grad: (torch.ops.autopar.tp_reduce(grad, ctx.group), None),
                          setup_context=_copy_setup)
COPY = torch.ops.autopar.tp_copy.default


def _vocab_ce(logits: torch.Tensor, target: torch.Tensor, group: str, start: int, ignore_index: int,
              reduction: int):
    """(the loss, each row's log-sum-exp) of the cross-entropy of rows whose classes are sharded:
    this rank holds classes [start, start + V/tp); max, sum of exponentials and the target's logit
    are reduced over the tp group in fp32 (``linear_ce.sharded_lse``), so the logits are never
    gathered."""
    valid, col, hit = linear_ce.target_columns(logits, target, ignore_index, start)
    lse, picked, _p, _total = linear_ce.sharded_lse(logits.float(), col, hit, group)
    per = torch.where(valid, lse - picked, 0.0)
    loss = per if reduction == 0 else per.sum() if reduction == 2 else per.sum() / valid.sum()
    return loss.to(logits.dtype), lse


@torch.library.custom_op("autopar::vocab_cross_entropy", mutates_args=())
def vocab_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group: str, start: int, ignore_index: int,
                        reduction: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``aten.cross_entropy_loss(logits, target, None, reduction, ignore_index)`` with the classes
    (dim 1 of ``[N, V]``) sharded over tp: (the loss, alike on every rank; each row's log-sum-exp,
    saved for the backward, which needs no communication)."""
    return _vocab_ce(logits, target, group, start, ignore_index, reduction)


@vocab_cross_entropy.register_fake
def _(logits, target, group, start, ignore_index, reduction):
    n = logits.shape[0]
    return logits.new_empty((n,) if reduction == 0 else ()), logits.new_empty((n,), dtype=torch.float32)


@torch.library.custom_op("autopar::vocab_cross_entropy_backward", mutates_args=())
def vocab_cross_entropy_backward(grad: torch.Tensor, logits: torch.Tensor, target: torch.Tensor, lse: torch.Tensor,
                                 start: int, ignore_index: int, reduction: int) -> torch.Tensor:
    """The gradient of this rank's logits: (softmax - one-hot of the target where it is one of
    this rank's classes) times the loss's gradient per row (mean: over the rows not ignored)."""
    valid = target != ignore_index
    g = grad.float()
    scale = g if reduction == 0 else g.expand(target.shape) / (valid.sum() if reduction == 1 else 1)
    p = (logits.float() - lse[:, None]).exp()
    return linear_ce.logits_grad(p, logits, target, ignore_index, [], scale, start)


@vocab_cross_entropy_backward.register_fake
def _(grad, logits, target, lse, start, ignore_index, reduction):
    return torch.empty_like(logits)


def _ce_setup(ctx, inputs, output):
    logits, target, _group, start, ignore_index, reduction = inputs
    ctx.save_for_backward(logits, target, output[1])
    ctx.args = (start, ignore_index, reduction)


def _ce_backward(ctx, grad, _grad_lse):
    logits, target, lse = ctx.saved_tensors
    return (torch.ops.autopar.vocab_cross_entropy_backward(grad, logits, target, lse, *ctx.args),
            None, None, None, None, None)


vocab_cross_entropy.register_autograd(_ce_backward, setup_context=_ce_setup)
VOCAB_CE = torch.ops.autopar.vocab_cross_entropy.default


# -- sequence parallelism's collectives (passes/sequence_parallel.py) -------------------------------------------------


def _block_shape(x: torch.Tensor, dim: int, tp: int, scale) -> list[int]:
    shape = list(x.shape)
    shape[dim] = scale(shape[dim], tp)
    return shape


@torch.library.custom_op("autopar::sp_all_gather", mutates_args=())
def sp_all_gather(x: torch.Tensor, group: str, dim: int, tp: int) -> torch.Tensor:
    """Forward: every rank's block along ``dim``, concatenated (a column's input); backward: the
    reduce-scatter of the gradient (each rank's holds its heads' part for every token)."""
    return comms.gathered_along(x, group, dim)


@torch.library.custom_op("autopar::sp_reduce_scatter", mutates_args=())
def sp_reduce_scatter(x: torch.Tensor, group: str, dim: int, tp: int) -> torch.Tensor:
    """Forward: this rank's block along ``dim`` of the sum over tp (a row's partial sums);
    backward: the all-gather of the gradient."""
    return comms.scattered_sum_along(x, group, dim)


@torch.library.custom_op("autopar::sp_gather", mutates_args=())
def sp_gather(x: torch.Tensor, group: str, dim: int, tp: int) -> torch.Tensor:
    """Forward: the whole value from every rank's block (read by replicated ops); backward: the
    rank's block of the gradient (every rank computes the same one)."""
    return comms.gathered_along(x, group, dim)


@torch.library.custom_op("autopar::sp_split", mutates_args=())
def sp_split(x: torch.Tensor, group: str, dim: int, tp: int) -> torch.Tensor:
    """Forward: this rank's block along ``dim`` of a replicated value; backward: the all-gather of
    the gradient."""
    n = x.shape[dim] // tp
    return x.narrow(dim, comms.rank_in(group) * n, n).clone(memory_format=torch.contiguous_format)


for _op_, _scale in ((sp_all_gather, int.__mul__), (sp_gather, int.__mul__), (sp_reduce_scatter, int.__floordiv__),
                     (sp_split, int.__floordiv__)):
    _op_.register_fake(lambda x, group, dim, tp, _s=_scale: x.new_empty(_block_shape(x, dim, tp, _s)))


def _setup(ctx, inputs, output):
    ctx.args = inputs[1:]


sp_all_gather.register_autograd(lambda ctx, g: (sp_reduce_scatter(g, *ctx.args), None, None, None),
                                setup_context=_setup)
sp_reduce_scatter.register_autograd(lambda ctx, g: (sp_all_gather(g, *ctx.args), None, None, None),
                                    setup_context=_setup)
sp_gather.register_autograd(lambda ctx, g: (sp_split(g, *ctx.args), None, None, None), setup_context=_setup)
sp_split.register_autograd(lambda ctx, g: (sp_all_gather(g, *ctx.args), None, None, None), setup_context=_setup)

ALL_GATHER = torch.ops.autopar.sp_all_gather.default
REDUCE_SCATTER = torch.ops.autopar.sp_reduce_scatter.default
GATHER = torch.ops.autopar.sp_gather.default
SPLIT = torch.ops.autopar.sp_split.default
SP_COLLECTIVES = frozenset({ALL_GATHER, REDUCE_SCATTER, GATHER})  # (sp_split only narrows)
