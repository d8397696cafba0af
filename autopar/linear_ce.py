"""Chunked linear cross-entropy: the LM head and its loss without the ``[tokens, vocab]`` logits.

``loss_tok, lse, grad_h = torch.ops.autopar.linear_ce_forward(h, weight, bias, target,
ignore_index, chunk, epilogue, values)`` is, token for token, what

    z = epilogue(torch.nn.functional.linear(h, weight, bias))      # [N, V]
    loss_tok = cross_entropy(z, target, ignore_index=ignore_index, reduction="none")

computes (in fp32: ``loss_tok`` and the log-sum-exp ``lse`` of every token are fp32), one chunk of
``chunk`` tokens at a time: only one chunk's logits exist at any moment, and nothing of size
``[N, V]`` is kept for the backward. ``epilogue`` is the
element-wise chain between the head and the loss, as comma-separated op names with one
constant each in ``values``: ``"to:<dtype>"`` (a cast, e.g. the ``logits.float()`` of Hugging Face models),
``"mul"``, ``"div"`` (by the constant) and ``"tanh"`` (logit soft-capping is
``div c, tanh, mul c``).

The hidden states' gradient is computed in the forward, from the same chunk logits, for a unit
gradient of each token's loss (a token's gradient is linear in its loss's gradient): the
backward's input-gradient part (I, what the previous stage waits for) only scales it, and the
weight gradient (W, deferrable) recomputes each chunk's logits in ``linear_ce_grad_weight``.
Cost: four head GEMMs a microbatch (forward 2, W 2) where the loss as captured runs three;
kept from F: ``h``, the targets, ``lse`` and the ``[N, d]`` unit gradient. Weight gradients are
accumulated over the chunks in fp32.

passes/chunked_loss.py puts these ops in place of a captured head + ``cross_entropy``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from autopar.collectives import comms


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


def target_columns(z: torch.Tensor, target: torch.Tensor, ignore_index: int,
            start: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(valid tokens, each token's target column in ``z``, 0 where it is not there; the tokens
    whose target is a column of ``z``: ``z`` holds the classes [start, start + its width))."""
    valid = target != ignore_index
    local = target - start
    hit = valid & (local >= 0) & (local < z.shape[-1])
    return valid, torch.where(hit, local, torch.zeros_like(local)), hit


def sharded_lse(zf: torch.Tensor, col: torch.Tensor, hit: torch.Tensor, pg=None):
    """(each row's log-sum-exp, its target logit, exp(z - row max), the row sums of that) of the
    fp32 logits ``zf`` whose classes may be sharded over the process group ``pg`` (or its name): the row max
    all-reduced (MAX), then the sums and the target logits (``col`` where ``hit``) in one SUM.
    The exponentials are one fp32 buffer the caller may overwrite."""
    m = zf.amax(dim=-1)
    if pg is not None:
        comms.all_reduce_max(m, pg)
    p = zf - m[:, None]
    p.exp_()
    both = torch.stack([p.sum(dim=-1), torch.where(hit, zf.gather(1, col[:, None]).squeeze(1), 0.0)])
    if pg is not None:
        comms.all_reduce_sum(both, comms.process_group(pg))
    return m + both[0].log(), both[1], p, both[0]


def logits_grad(p, z, target_c, ignore_index, trail, scale=None, start: int = 0) -> torch.Tensor:
    """d loss_tok / d (head output) of one chunk from its probabilities ``p`` (fp32, overwritten),
    times ``scale`` per token (None: 1), in the head's dtype."""
    valid, col, hit = target_columns(z, target_c, ignore_index, start)
    p.scatter_add_(1, col[:, None], -hit.to(p.dtype)[:, None])
    p.mul_((valid.to(p.dtype) if scale is None else torch.where(valid, scale.float(), 0.0))[:, None])
    return _epilogue_backward(p.to(z.dtype), trail)


def _casts_only(ops: str) -> bool:
    """The epilogue is casts alone (``.float()``): the loss's gradient reaches the head output
    unchanged, and both backward GEMMs can take the one-hot part of ``softmax - onehot`` as a row
    gather instead of a pass over the ``[chunk, vocab]`` probabilities."""
    return all(op.startswith("to:") for op in ops.split(",")) if ops else True


def _forward(h, weight, bias, target, ignore_index, chunk, ops, values, group: str = "", start: int = 0):
    """``group``: the vocabulary is sharded over this process group (tensor parallelism):
    ``weight`` holds the classes [start, start + its rows); each chunk's row max, sum of
    exponentials and target logit are reduced over the group (fp32), and the hidden states'
    gradient is this rank's part (the caller sums it over the group)."""
    n = h.shape[0]
    loss = h.new_empty(n, dtype=torch.float32)
    lse = h.new_empty(n, dtype=torch.float32)
    grad_h = torch.empty_like(h)
    fast = _casts_only(ops)
    pg = group or None
    for a, b in _chunks(n, chunk):
        z, trail = _epilogue(F.linear(h[a:b], weight, bias), ops, values)
        zf = z.float()
        valid, col, hit = target_columns(z, target[a:b], ignore_index, start)
        if fast or pg is not None:
            lse_c, picked, p, total = sharded_lse(zf, col, hit, pg)
            if fast:
                z0 = trail[0][2] if trail else z  # the head's output, in its dtype
                # ((p / total - onehot) * valid) @ W, the one-hot part as rows of W
                gh = p.to(z0.dtype) @ weight
                gh.mul_((valid / total)[:, None].to(gh.dtype))
                gh.sub_(weight[col] * hit[:, None].to(weight.dtype))
                del z0
            else:
                p.div_(total[:, None])
                gh = logits_grad(p, z, target[a:b], ignore_index, trail, start=start) @ weight
        else:
            lse_c = torch.logsumexp(zf, dim=-1)
            picked = zf.gather(1, col[:, None]).squeeze(1)
            p = zf - lse_c[:, None]
            p.exp_()  # in place: one [chunk, vocab] fp32 buffer for the probabilities and their gradient
            gh = logits_grad(p, z, target[a:b], ignore_index, trail) @ weight
        loss[a:b] = torch.where(valid, lse_c - picked, 0.0)
        lse[a:b] = lse_c
        grad_h[a:b] = gh
        del z, zf, trail, p, gh  # before the next chunk's are made
    return loss, lse, grad_h


def _grad_weight(grad_tok, h, weight, bias, target, lse, ignore_index, chunk, ops, values, start: int = 0,
                 into: torch.Tensor | None = None) -> list[torch.Tensor]:
    """The head's weight (and bias) gradient, accumulated over the chunks in fp32, or added into
    ``into`` (the weight's gradient accumulator, any dtype; no bias) in place."""
    n = h.shape[0]
    gw = into if into is not None else torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
    gb = None if bias is None else torch.zeros(bias.shape, dtype=torch.float32, device=bias.device)
    fast = _casts_only(ops)
    for a, b in _chunks(n, chunk):
        z, trail = _epilogue(F.linear(h[a:b], weight, bias), ops, values)
        p = z.float() - lse[a:b, None]
        p.exp_()  # in place: one [chunk, vocab] fp32 buffer for the probabilities (and their gradient)
        if fast:
            # sum_i scale_i (p_i - onehot_i)^T h_i: the token scales on the [chunk, d] rows of h,
            # the one-hot part added into the target rows
            valid, col, hit = target_columns(z, target[a:b], ignore_index, start)
            scale = torch.where(valid, grad_tok[a:b].float(), 0.0)
            z0 = trail[0][2] if trail else z
            rows = h[a:b] * scale[:, None].to(h.dtype)
            g = p.to(z0.dtype)
            del z, z0, trail
            gw.add_(g.t() @ rows) if gw.dtype != g.dtype else gw.addmm_(g.t(), rows)
            gw.index_add_(0, col, -(rows * hit[:, None].to(rows.dtype)).to(gw.dtype))
            if gb is not None:
                gb.add_(p.t() @ scale)
                gb.index_add_(0, col, -scale * hit)
            del p, g
            continue
        g = logits_grad(p, z, target[a:b], ignore_index, trail, grad_tok[a:b], start)
        del z, trail, p
        if gw.dtype == g.dtype:
            gw.addmm_(g.t(), h[a:b])
        else:
            gw.add_(g.t() @ h[a:b])
        if gb is not None:
            gb.add_(g.sum(0, dtype=torch.float32))
        del g
    if into is not None:
        return []
    return [gw.to(weight.dtype)] + ([] if gb is None else [gb.to(bias.dtype)])


@torch.library.custom_op("autopar::linear_ce_forward", mutates_args=())
def linear_ce_forward(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, target: torch.Tensor,
                      ignore_index: int, chunk: int, ops: str, values: list[float], group: str = "", start: int = 0
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _forward(h, weight, bias, target, ignore_index, chunk, ops, values, group, start)


@linear_ce_forward.register_fake
def _(h, weight, bias, target, ignore_index, chunk, ops, values, group="", start=0):
    n = h.shape[0]
    return h.new_empty(n, dtype=torch.float32), h.new_empty(n, dtype=torch.float32), torch.empty_like(h)


@torch.library.custom_op("autopar::linear_ce_grad_weight", mutates_args=())
def linear_ce_grad_weight(grad_tok: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                          target: torch.Tensor, lse: torch.Tensor, ignore_index: int, chunk: int, ops: str,
                          values: list[float], start: int = 0) -> list[torch.Tensor]:
    return _grad_weight(grad_tok, h, weight, bias, target, lse, ignore_index, chunk, ops, values, start)


@linear_ce_grad_weight.register_fake
def _(grad_tok, h, weight, bias, target, lse, ignore_index, chunk, ops, values, start=0):
    return [torch.empty_like(weight)] + ([] if bias is None else [torch.empty_like(bias)])


@torch.library.custom_op("autopar::linear_ce_grad_weight_into", mutates_args=("acc",))
def linear_ce_grad_weight_into(acc: torch.Tensor, grad_tok: torch.Tensor, h: torch.Tensor, weight: torch.Tensor,
                               bias: torch.Tensor | None, target: torch.Tensor, lse: torch.Tensor, ignore_index: int,
                               chunk: int, ops: str, values: list[float], start: int = 0) -> None:
    """``linear_ce_grad_weight`` added into the weight's gradient accumulator ``acc`` in place
    (no bias): gradient accumulation over microbatches without a fresh ``[vocab, d]`` gradient
    (passes/exec_code.py puts it in place of the op when the runtime accumulates)."""
    if bias is not None:
        raise ValueError("autopar.linear_ce: linear_ce_grad_weight_into takes a head without bias")
    _grad_weight(grad_tok, h, weight, bias, target, lse, ignore_index, chunk, ops, values, start, into=acc)


@linear_ce_grad_weight_into.register_fake
def _(acc, grad_tok, h, weight, bias, target, lse, ignore_index, chunk, ops, values, start=0):
    return None


def _setup(ctx, inputs, output):
    h, weight, bias, target, ignore_index, chunk, ops, values, _group, start = inputs
    _loss, lse, grad_h = output
    ctx.save_for_backward(h, weight, bias, target, lse, grad_h)
    ctx.args = (ignore_index, chunk, ops, list(values), start)
    ctx.mark_non_differentiable(lse, grad_h)


def _autograd_backward(ctx, grad_tok, _grad_lse, _grad_grad_h):
    h, weight, bias, target, lse, grad_h = ctx.saved_tensors
    need_h, need_w, need_b = ctx.needs_input_grad[:3]
    # a token's hidden-state gradient is linear in its loss's gradient: the forward's, scaled
    gh = (grad_h * grad_tok[:, None].to(grad_h.dtype)) if need_h else None
    gw = gb = None
    if need_w or need_b:
        weight_grads = torch.ops.autopar.linear_ce_grad_weight(grad_tok, h, weight, bias, target, lse, *ctx.args)
        gw = weight_grads[0] if need_w else None
        gb = weight_grads[1] if need_b and bias is not None else None
    return gh, gw, gb, None, None, None, None, None, None, None


linear_ce_forward.register_autograd(_autograd_backward, setup_context=_setup)

FORWARD_OP = torch.ops.autopar.linear_ce_forward.default
GRAD_WEIGHT_OP = torch.ops.autopar.linear_ce_grad_weight.default
GRAD_WEIGHT_INTO_OP = torch.ops.autopar.linear_ce_grad_weight_into.default


def flops(target, shapes) -> int | None:
    """FLOPs of one call of these ops from its arguments' shapes (None for another op): the head
    GEMM is 2·N·d·V; the forward runs it twice (the logits, then the hidden states' gradient),
    the weight-gradient op twice (the recomputed logits, then its own GEMM)."""
    if target is FORWARD_OP:
        h, weight = shapes[0], shapes[1]
    elif target is GRAD_WEIGHT_OP:
        h, weight = shapes[1], shapes[2]
    elif target is GRAD_WEIGHT_INTO_OP:
        h, weight = shapes[2], shapes[3]
    else:
        return None
    return 2 * 2 * int(h[0]) * int(h[1]) * int(weight[0])


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


def working_bytes_per_token(vocab: int, head_itemsize: int, fp32_steps: int) -> int:
    """Bytes the ops hold at once per token of a chunk (their peak, inside the kernels, beyond
    their inputs and outputs): the head's output, each fp32 element-wise step of
    the epilogue, one fp32 ``[chunk, vocab]`` buffer (the exponential ``logsumexp`` forms, then the
    probabilities and their gradient), and that gradient cast back to the head's dtype when it
    is narrower."""
    return vocab * (head_itemsize + 4 * fp32_steps + 4 + (head_itemsize if head_itemsize < 4 else 0))


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
    loss_tok, _lse, _grad_h = torch.ops.autopar.linear_ce_forward(h, weight, bias, target, ignore_index,
                                                                  int(chunk_tokens), ops, values)
    if reduction == "none":
        return loss_tok
    total = loss_tok.sum()
    return total if reduction == "sum" else total / (target != ignore_index).sum()
