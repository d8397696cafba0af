"""Chunked linear cross-entropy: the LM head and its loss without the ``[tokens, vocab]`` logits.

``loss_tok, lse = torch.ops.autopar.linear_ce_forward(h, weight, bias, target, ignore_index,
chunk, epilogue, values)`` is, token for token, what

    z = epilogue(torch.nn.functional.linear(h, weight, bias))      # [N, V]
    loss_tok = cross_entropy(z, target, ignore_index=ignore_index, reduction="none")

computes (in fp32: ``loss_tok`` and the log-sum-exp ``lse`` of every token are fp32), one chunk of
``chunk`` tokens at a time: only one chunk's logits exist at any moment, and nothing of size
``[N, V]`` is kept for the backward (``h``, ``target`` and ``lse`` are). ``epilogue`` is the
element-wise chain between the head and the loss, as comma-separated op names with one
constant each in ``values``: ``"to:<dtype>"`` (a cast, e.g. the ``logits.float()`` of Hugging Face models),
``"mul"``, ``"div"`` (by the constant) and ``"tanh"`` (logit soft-capping is
``div c, tanh, mul c``).

The backward recomputes each chunk's logits and is split the way pipeline schedules want it:
``linear_ce_grad_input`` (the hidden states' gradient, what the previous stage waits for: I)
and ``linear_ce_grad_weight`` (the head's weight and bias gradients: W, deferrable); each
recomputes the chunk logits it needs. ``linear_ce_grad`` computes all of them in one pass over
the chunks, for a program that runs both (the fused B; passes/exec_code.py merges the pair).
Weight gradients are accumulated over the chunks in fp32.

passes/chunked_loss.py puts these ops in place of a captured head + ``cross_entropy``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def _epilogue(z: torch.Tensor, ops: str, values: list[float]) -> tuple[torch.Tensor, list]:
    """``z`` through the element-wise chain; the trail the backward walks back."""
    trail = []
    for op, v in zip(ops.split(",") if ops else (), values):
        x = z
        if op.startswith("to:"):
            z = z.to(getattr(torch, op[3:]))
        elif op == "mul":
            z = z * v
        elif op == "div":
            z = z / v
        elif op == "tanh":
            z = torch.tanh(z)
        else:
            raise ValueError(f"autopar.linear_ce: unknown epilogue op {op!r}")
        trail.append((op, v, x, z))
    return z, trail


def _epilogue_backward(g: torch.Tensor, trail: list) -> torch.Tensor:
    for op, v, x, y in reversed(trail):
        if op.startswith("to:"):
            g = g.to(x.dtype)
        elif op == "mul":
            g = g * v
        elif op == "div":
            g = g / v
        elif op == "tanh":
            g = g * (1 - y * y)
    return g


def _chunks(n: int, chunk: int):
    step = chunk if chunk > 0 else max(n, 1)
    return [(i, min(i + step, n)) for i in range(0, n, step)]


def _picked(z: torch.Tensor, target: torch.Tensor, ignore_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(valid tokens, each token's target column, 0 where ignored)."""
    valid = target != ignore_index
    return valid, torch.where(valid, target, torch.zeros_like(target))


def _forward(h, weight, bias, target, ignore_index, chunk, ops, values):
    n = h.shape[0]
    loss = h.new_empty(n, dtype=torch.float32)
    lse = h.new_empty(n, dtype=torch.float32)
    for a, b in _chunks(n, chunk):
        z, _ = _epilogue(F.linear(h[a:b], weight, bias), ops, values)
        zf = z.float()
        lse_c = torch.logsumexp(zf, dim=-1)
        valid, col = _picked(z, target[a:b], ignore_index)
        loss[a:b] = torch.where(valid, lse_c - zf.gather(1, col[:, None]).squeeze(1), 0.0)
        lse[a:b] = lse_c
    return loss, lse


def _chunk_grad(grad_tok, h_c, weight, bias, target_c, lse_c, ignore_index, ops, values) -> torch.Tensor:
    """d loss / d (head output) of one chunk, in the head's dtype."""
    z, trail = _epilogue(F.linear(h_c, weight, bias), ops, values)
    p = z.float() - lse_c[:, None]
    p.exp_()  # in place: one [chunk, vocab] fp32 buffer for the probabilities and their gradient
    valid, col = _picked(z, target_c, ignore_index)
    p.scatter_add_(1, col[:, None], -valid.to(p.dtype)[:, None])
    p.mul_(torch.where(valid, grad_tok.float(), 0.0)[:, None])
    return _epilogue_backward(p.to(z.dtype), trail)


def _backward(grad_tok, h, weight, bias, target, lse, ignore_index, chunk, ops, values, want_input, want_weight):
    n = h.shape[0]
    gh = torch.empty_like(h) if want_input else None
    gw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_weight else None
    gb = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if want_weight and bias is not None else None
    for a, b in _chunks(n, chunk):
        g = _chunk_grad(grad_tok[a:b], h[a:b], weight, bias, target[a:b], lse[a:b], ignore_index, ops, values)
        if want_input:
            gh[a:b] = g @ weight
        if want_weight:
            if gw.dtype == g.dtype:
                gw.addmm_(g.t(), h[a:b])
            else:
                gw.add_(g.t() @ h[a:b])
            if gb is not None:
                gb.add_(g.sum(0, dtype=torch.float32))
    weight_grads = [] if gw is None else [gw.to(weight.dtype)] + ([] if gb is None else [gb.to(bias.dtype)])
    return gh, weight_grads


@torch.library.custom_op("autopar::linear_ce_forward", mutates_args=())
def linear_ce_forward(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, target: torch.Tensor,
                      ignore_index: int, chunk: int, ops: str, values: list[float]
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    return _forward(h, weight, bias, target, ignore_index, chunk, ops, values)


@linear_ce_forward.register_fake
def _(h, weight, bias, target, ignore_index, chunk, ops, values):
    return h.new_empty(h.shape[0], dtype=torch.float32), h.new_empty(h.shape[0], dtype=torch.float32)


@torch.library.custom_op("autopar::linear_ce_grad_input", mutates_args=())
def linear_ce_grad_input(grad_tok: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         target: torch.Tensor, lse: torch.Tensor, ignore_index: int, chunk: int, ops: str,
                         values: list[float]) -> torch.Tensor:
    return _backward(grad_tok, h, weight, bias, target, lse, ignore_index, chunk, ops, values, True, False)[0]


@linear_ce_grad_input.register_fake
def _(grad_tok, h, weight, bias, target, lse, ignore_index, chunk, ops, values):
    return torch.empty_like(h)


@torch.library.custom_op("autopar::linear_ce_grad_weight", mutates_args=())
def linear_ce_grad_weight(grad_tok: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                          target: torch.Tensor, lse: torch.Tensor, ignore_index: int, chunk: int, ops: str,
                          values: list[float]) -> list[torch.Tensor]:
    return _backward(grad_tok, h, weight, bias, target, lse, ignore_index, chunk, ops, values, False, True)[1]


@linear_ce_grad_weight.register_fake
def _(grad_tok, h, weight, bias, target, lse, ignore_index, chunk, ops, values):
    return [torch.empty_like(weight)] + ([] if bias is None else [torch.empty_like(bias)])


@torch.library.custom_op("autopar::linear_ce_grad", mutates_args=())
def linear_ce_grad(grad_tok: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   target: torch.Tensor, lse: torch.Tensor, ignore_index: int, chunk: int, ops: str,
                   values: list[float]) -> list[torch.Tensor]:
    gh, weight_grads = _backward(grad_tok, h, weight, bias, target, lse, ignore_index, chunk, ops, values, True, True)
    return [gh, *weight_grads]


@linear_ce_grad.register_fake
def _(grad_tok, h, weight, bias, target, lse, ignore_index, chunk, ops, values):
    return [torch.empty_like(h), torch.empty_like(weight)] + ([] if bias is None else [torch.empty_like(bias)])


def _setup(ctx, inputs, output):
    h, weight, bias, target, ignore_index, chunk, ops, values = inputs
    ctx.save_for_backward(h, weight, bias, target, output[1])
    ctx.args = (ignore_index, chunk, ops, list(values))
    ctx.mark_non_differentiable(output[1])


def _autograd_backward(ctx, grad_tok, _grad_lse):
    h, weight, bias, target, lse = ctx.saved_tensors
    need_h, need_w, need_b = ctx.needs_input_grad[:3]
    ops = torch.ops.autopar
    gh = ops.linear_ce_grad_input(grad_tok, h, weight, bias, target, lse, *ctx.args) if need_h else None
    gw = gb = None
    if need_w or need_b:
        weight_grads = ops.linear_ce_grad_weight(grad_tok, h, weight, bias, target, lse, *ctx.args)
        gw = weight_grads[0] if need_w else None
        gb = weight_grads[1] if need_b and bias is not None else None
    return gh, gw, gb, None, None, None, None, None


linear_ce_forward.register_autograd(_autograd_backward, setup_context=_setup)

FORWARD_OP = torch.ops.autopar.linear_ce_forward.default
GRAD_INPUT_OP = torch.ops.autopar.linear_ce_grad_input.default
GRAD_WEIGHT_OP = torch.ops.autopar.linear_ce_grad_weight.default
GRAD_OP = torch.ops.autopar.linear_ce_grad.default


def flops(target, shapes) -> int | None:
    """FLOPs of one call of these ops from its arguments' shapes (None for another op): the head
    GEMM is 2·N·d·V; the forward runs it once, each split backward op twice (recomputed logits,
    then its own gradient GEMM), the fused one three times."""
    times = {FORWARD_OP: 1, GRAD_INPUT_OP: 2, GRAD_WEIGHT_OP: 2, GRAD_OP: 3}.get(target)
    if times is None:
        return None
    h, weight = (shapes[0], shapes[1]) if target is FORWARD_OP else (shapes[1], shapes[2])
    return times * 2 * int(h[0]) * int(h[1]) * int(weight[0])


# one chunk's logits hold at most this many elements (256 MiB in fp32): small enough to keep
# the loss's working set near a gigabyte at any vocabulary, large enough for efficient GEMMs
CHUNK_ELEMENTS = 2 ** 26


def default_chunk(vocab: int) -> int:
    """Tokens per chunk for a vocabulary: the largest power of two whose ``[chunk, vocab]``
    logits hold at most ``CHUNK_ELEMENTS`` elements, within [128, 32768]."""
    c = 128
    while c * 2 * vocab <= CHUNK_ELEMENTS and c < 32768:
        c *= 2
    return c


def working_bytes(chunk: int, vocab: int, head_itemsize: int, fp32_steps: int) -> int:
    """Bytes the ops hold at once for one chunk of ``chunk`` tokens (their peak, inside the
    kernels, beyond their inputs and outputs): the head's output, each fp32 element-wise step of
    the epilogue, and two fp32 ``[chunk, vocab]`` buffers (the probabilities and, in the forward,
    the exponential ``logsumexp`` forms; in the backward, the gradient cast back)."""
    return chunk * vocab * (head_itemsize + 4 * fp32_steps + 8)


def linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, bias: torch.Tensor | None = None,
                         *, ignore_index: int = -100, reduction: str = "mean", chunk_tokens: int = 4096,
                         epilogue: tuple[tuple[str, float], ...] = ()) -> torch.Tensor:
    """``cross_entropy(epilogue(linear(h, weight, bias)), target)`` over ``[N, d]`` hidden states,
    ``chunk_tokens`` tokens at a time (module docstring); differentiable. ``reduction``: "mean"
    (over the tokens whose target is not ``ignore_index``), "sum" or "none"."""
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"autopar.linear_cross_entropy: reduction={reduction!r} must be 'mean', 'sum' or 'none'")
    ops = ",".join(op for op, _v in epilogue)
    values = [float(v) for _op, v in epilogue]
    loss_tok, _lse = torch.ops.autopar.linear_ce_forward(h, weight, bias, target, ignore_index, int(chunk_tokens),
                                                         ops, values)
    if reduction == "none":
        return loss_tok
    total = loss_tok.sum()
    return total if reduction == "sum" else total / (target != ignore_index).sum()
