"""Eager reference for the numerics contract (design.md §5).

One process, no parallelism: the global batch is cut into ``dp`` contiguous replica slices,
each into ``num_microbatches`` equal microbatches; the microbatches run in order
(replica 0 mb 0..m-1, replica 1 mb 0..m-1, ...) with gradient accumulation of
``loss / n_total`` (``n_total = dp * num_microbatches``), then one ``optimizer.step()``.
autopar's ``pm.step`` must reproduce the returned losses and the final state (parameters and,
with dp = 1, buffers) to fp32 tolerance.
"""

from __future__ import annotations

import contextlib
import copy
import math
from typing import Any, Callable, Iterable, Optional
from unittest import mock

import torch
import torch.nn as nn
from torch.utils import _pytree as pytree

__all__ = ["split_batch", "eager_reference", "eager_mixed_reference", "assert_close_state", "state_copy"]


def split_batch(tensor: torch.Tensor, dp: int, num_microbatches: int) -> list[list[torch.Tensor]]:
    """Split ``tensor`` along dim 0 into ``dp`` contiguous slices, each into
    ``num_microbatches`` equal microbatches: ``result[replica][microbatch]``."""
    if dp < 1 or num_microbatches < 1:
        raise ValueError(f"dp={dp} and num_microbatches={num_microbatches} must be >= 1")
    n = tensor.shape[0]
    n_total = dp * num_microbatches
    if n % n_total:
        raise ValueError(f"batch size {n} is not divisible by dp * num_microbatches = "
                         f"{dp} * {num_microbatches} = {n_total}")
    mb = n // n_total
    chunks = list(torch.split(tensor, mb, dim=0))
    return [chunks[r * num_microbatches:(r + 1) * num_microbatches] for r in range(dp)]


def _split_tree(tree: Any, dp: int, num_microbatches: int) -> list[Any]:
    """Split every tensor leaf of a pytree; returns the flat microbatch list in contract order
    (replica-major). Non-tensor leaves are passed unchanged to every microbatch."""
    leaves, spec = pytree.tree_flatten(tree)
    n_total = dp * num_microbatches
    per_leaf = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            parts = split_batch(leaf, dp, num_microbatches)
            per_leaf.append([p for replica in parts for p in replica])
        else:
            per_leaf.append([leaf] * n_total)
    return [pytree.tree_unflatten([pl[i] for pl in per_leaf], spec) for i in range(n_total)]


def state_copy(model: nn.Module) -> dict[str, torch.Tensor]:
    """``{fqn: tensor.clone()}`` of ``model.state_dict()`` (parameters and persistent buffers;
    a tied parameter appears under each of its names)."""
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def eager_reference(
    model: nn.Module,
    inputs: tuple,
    target: Any,
    loss_fn: Optional[Callable[[Any, Any], torch.Tensor]],
    optimizer_factory: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer],
    *,
    dp: int = 1,
    num_microbatches: int = 1,
    steps: int = 2,
    param_groups: Optional[Callable] = None,
    scheduler: Optional[Callable] = None,
    max_grad_norm: Optional[float] = None,
    norms: Optional[list] = None,
) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """Design.md §5: split the global batch into dp contiguous slices, each into
    num_microbatches equal microbatches (order: replica 0 mb 0..m-1, replica 1 ...); for each:
    ``(loss_fn(model(*x_mb), y_mb) / n_total).backward()``; then ``optimizer.step()``;
    ``optimizer.zero_grad()``. The same global batch is used at every step.

    Works on a deep copy of ``model`` (the caller's model is not touched) in which every
    ``autopar.nn.MoE`` block is its plain-PyTorch twin (``plain_moe``): no reference runs
    autopar code. ``loss_fn=None``
    means the model output is the loss (``target`` is then ignored). ``optimizer_factory``
    takes an iterable of parameters, e.g. ``functools.partial(torch.optim.SGD, lr=0.1)``.

    ``param_groups(fqn, p) -> options``: the optimizer gets one group per option set;
    ``scheduler(optimizer)``: an lr scheduler stepped after every optimizer step;
    ``max_grad_norm``: ``torch.nn.utils.clip_grad_norm_`` before each step (its norms appended
    to ``norms``).

    Returns ``(losses, state)``: ``losses[s]`` is a detached 0-dim tensor, the sum of the
    scaled microbatch losses of step ``s``; ``state`` is ``{fqn: tensor.clone()}`` of the final
    ``state_dict()`` including buffers.
    """
    model = plain_moe(model)
    n_total = dp * num_microbatches
    x_mbs = _split_tree(tuple(inputs), dp, num_microbatches)
    y_mbs = (_split_tree(target, dp, num_microbatches) if loss_fn is not None
             else [None] * n_total)
    if param_groups is None:
        optimizer = optimizer_factory(model.parameters())
    else:
        sets: list[tuple[dict, list]] = []
        for fqn, p in model.named_parameters():
            opts = param_groups(fqn, p) or {}
            for o, ps in sets:
                if o == opts:
                    ps.append(p)
                    break
            else:
                sets.append((opts, [p]))
        optimizer = optimizer_factory([{"params": ps, **o} for o, ps in sets])
    sched = scheduler(optimizer) if scheduler is not None else None
    optimizer.zero_grad(set_to_none=True)
    losses: list[torch.Tensor] = []
    for _ in range(steps):
        total = None
        for x_mb, y_mb in zip(x_mbs, y_mbs):
            out = model(*x_mb)
            loss = out if loss_fn is None else loss_fn(out, y_mb)
            scaled = loss / n_total
            scaled.backward()
            total = scaled.detach() if total is None else total + scaled.detach()
        losses.append(total)
        if max_grad_norm is not None:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
            if norms is not None:
                norms.append(norm.detach())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if sched is not None:
            sched.step()
    return losses, state_copy(model)


def eager_mixed_reference(model: nn.Module, inputs: tuple, target: Any, loss_fn, optimizer_factory, *,
                          param_dtype: torch.dtype = torch.bfloat16, dp: int = 1, num_microbatches: int = 1,
                          steps: int = 2) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """Design.md §5, mixed precision: a ``param_dtype`` copy of the model runs each microbatch's
    forward and backward; its parameter gradients are accumulated in fp32 over the microbatches;
    the optimizer steps fp32 masters (the model as given), which are cast into the compute copy
    after each step. Returns (losses as fp32 sums of the scaled microbatch losses, the masters'
    state with the compute copy's buffers). MoE blocks as in ``eager_reference``."""
    masters = plain_moe(model)
    compute = plain_moe(model)
    for p in compute.parameters():
        if p.is_floating_point():
            p.data = p.data.to(param_dtype)
    n_total = dp * num_microbatches
    x_mbs = _split_tree(tuple(inputs), dp, num_microbatches)
    y_mbs = _split_tree(target, dp, num_microbatches) if loss_fn is not None else [None] * n_total
    optimizer = optimizer_factory(masters.parameters())
    pairs = list(zip(masters.parameters(), compute.parameters()))
    losses = []
    for _ in range(steps):
        acc = [torch.zeros_like(m, dtype=torch.float32) for m, _c in pairs]
        total = torch.zeros((), dtype=torch.float32)
        for x_mb, y_mb in zip(x_mbs, y_mbs):
            out = compute(*x_mb)
            loss = out if loss_fn is None else loss_fn(out, y_mb)
            scaled = loss / n_total
            grads = torch.autograd.grad(scaled, [c for _m, c in pairs], allow_unused=True)
            for a, g in zip(acc, grads):
                if g is not None:
                    a.add_(g)
            total += scaled.detach().float()
        losses.append(total)
        for (m, _c), a in zip(pairs, acc):
            m.grad = a
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            for m, c in pairs:
                c.copy_(m)
    state = state_copy(masters)
    param_names = {k for k, _ in masters.named_parameters(remove_duplicate=False)}
    state.update({k: v.detach().clone() for k, v in compute.state_dict().items() if k not in param_names})
    return losses, state


def assert_close_state(actual: dict, expected: dict, rtol: float = 1e-5, atol: float = 1e-6,
                       ) -> None:
    """Compare two ``{fqn: tensor}`` dicts key by key (same key sets required).

    Floating tensors: ``|a - e| <= atol + rtol * |e|`` elementwise (NaN/inf must match
    exactly); integer and bool tensors (e.g. BatchNorm ``num_batches_tracked``) must be equal.
    Raises AssertionError naming the first mismatching key with its max abs/rel error.

    Why atol = 1e-6: rtol = 1e-5 is the fp32 contract (design.md §5), but a pure relative test
    fails on entries near zero (zero-initialised biases, a parameter whose update nearly
    cancels its value), where a different but equally valid summation order — microbatch
    accumulation, DP all-reduce, a pipeline stage's reduction — leaves an absolute residue of a
    few fp32 ulps of the *gradient* scale (~1e-7 for O(0.01..1) tensors). 1e-6 absorbs that
    and is still far below any real bug (a missing microbatch, a doubled or unscaled gradient
    changes parameters by ~lr * grad, typically >= 1e-4).

    The absolute floor also scales with the tensor: ``atol_eff = max(atol, rtol * max|e|)``.
    A direction whose exact gradient is zero (the key bias of attention: softmax ignores a
    constant shift of the scores) gets fp32 noise for a gradient, and Adam divides that noise
    by its own magnitude, moving such entries in a summation-order-dependent way; measured
    against the tensor's scale that is still a 1e-5 relative contract.
    """
    missing = [k for k in expected if k not in actual]
    extra = [k for k in actual if k not in expected]
    if missing or extra:
        raise AssertionError(f"state keys differ: missing from actual {missing}, "
                             f"unexpected in actual {extra}")
    for key, e in expected.items():
        a = actual[key]
        if not isinstance(a, torch.Tensor) or not isinstance(e, torch.Tensor):
            if a != e:
                raise AssertionError(f"{key}: {a!r} != {e!r}")
            continue
        a = a.detach().to(e.device)
        e = e.detach()
        if a.shape != e.shape:
            raise AssertionError(f"{key}: shape {tuple(a.shape)} != expected {tuple(e.shape)}")
        if a.dtype != e.dtype:
            raise AssertionError(f"{key}: dtype {a.dtype} != expected {e.dtype}")
        if not (e.is_floating_point() or e.is_complex()):
            if not torch.equal(a, e):
                diff = (a != e).nonzero()
                idx = tuple(diff[0].tolist())
                raise AssertionError(f"{key}: integer tensors differ in {diff.shape[0]} "
                                     f"entries; first at {idx}: {a[idx].item()} != "
                                     f"expected {e[idx].item()}")
            continue
        nonfinite_ok = torch.equal(torch.isnan(a), torch.isnan(e)) and torch.equal(
            torch.where(torch.isinf(a), a, torch.zeros_like(a)),
            torch.where(torch.isinf(e), e, torch.zeros_like(e)))
        finite = torch.isfinite(e) & torch.isfinite(a)
        abs_err = torch.where(finite, (a - e).abs(), torch.zeros_like(a))
        fin = e[torch.isfinite(e)]
        scale_atol = max(atol, rtol * float(fin.abs().max())) if fin.numel() else atol
        bad = abs_err > scale_atol + rtol * e.abs()
        if not nonfinite_ok or bool(bad.any()):
            rel_err = abs_err / e.abs().clamp_min(torch.finfo(e.dtype).tiny)
            max_abs = abs_err.max().item() if abs_err.numel() else 0.0
            max_rel = rel_err.max().item() if rel_err.numel() else 0.0
            n_bad = int(bad.sum())
            flat = int(bad.reshape(-1).nonzero()[0]) if n_bad else -1
            where = (f"; first bad flat index {flat}: actual {a.reshape(-1)[flat].item():.9g} "
                     f"expected {e.reshape(-1)[flat].item():.9g}") if n_bad else ""
            raise AssertionError(
                f"{key}: not close (rtol={rtol}, atol={atol}): {n_bad}/{e.numel()} elements off, "
                f"max abs err {max_abs:.3e}, max rel err {max_rel:.3e}"
                f"{'; NaN/inf pattern differs' if not nonfinite_ok else ''}{where}")


# -- MoE blocks as plain PyTorch (the EP tests' references never call autopar code) -------------


class _PlainExperts(nn.Module):
    """``E`` SwiGLU experts as stacked weights (the parameter names of ``GroupedExperts``)."""

    def __init__(self, w1, w3, w2):
        super().__init__()
        self.w1, self.w3, self.w2 = (nn.Parameter(w.detach().clone(), requires_grad=w.requires_grad)
                                     for w in (w1, w3, w2))

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        return (torch.nn.functional.silu(x @ self.w1[e]) * (x @ self.w3[e])) @ self.w2[e]


class _PlainSwiGLU(nn.Module):
    def __init__(self, src):
        super().__init__()
        self.w1, self.w2, self.w3 = (nn.Linear(lin.in_features, lin.out_features, bias=False) for lin in
                                     (src.w1, src.w2, src.w3))
        with torch.no_grad():
            for mine, theirs in ((self.w1, src.w1), (self.w2, src.w2), (self.w3, src.w3)):
                mine.weight.copy_(theirs.weight)

    def forward(self, x):
        return self.w2(torch.nn.functional.silu(self.w1(x)) * self.w3(x))


class PlainMoE(nn.Module):
    """The semantics of an ``autopar.nn.MoE`` written out in plain PyTorch, with the same
    parameter and buffer names (so states compare by FQN): a router ``Linear``; softmax (or
    sigmoid, normalized for the balance loss) scores; optional selection bias and group-limited
    selection for choosing only; top-k; gates renormalized and scaled; with a static capacity
    ``min(N, ceil(N k / E * capacity_factor))`` (at least 1) an assignment beyond its expert's
    capacity, counted choice-major (every token's first choice before any second), is dropped;
    each expert on the rows that chose it, gate-weighted and added back to their tokens (a
    Python loop over experts, as transformers' eager MoE); the shared expert added; the Switch
    load-balance loss ``w * E * sum(frac * mean probs)`` over all assignments (before dropping)."""

    def __init__(self, moe):
        super().__init__()
        for a in ("n_experts", "top_k", "aux_loss_weight", "score_func", "norm_topk_prob", "route_scale", "n_groups",
                  "topk_groups", "capacity_factor"):
            setattr(self, a, getattr(moe, a))
        self.router = nn.Linear(moe.router.in_features, moe.router.out_features, bias=False)
        with torch.no_grad():
            self.router.weight.copy_(moe.router.weight)
        e = moe.experts
        self.experts = _PlainExperts(e.w1, e.w3, e.w2)
        self.shared_expert = _PlainSwiGLU(moe.shared_expert) if moe.shared_expert is not None else None
        bias = getattr(moe, "e_score_correction_bias", None)
        if bias is not None:
            self.register_buffer("e_score_correction_bias", bias.detach().clone())
        else:
            self.e_score_correction_bias = None

    def forward(self, x):
        xf = x.reshape(-1, x.shape[-1])
        logits = self.router(xf).float()
        scores = logits.softmax(-1) if self.score_func == "softmax" else logits.sigmoid()
        probs = scores if self.score_func == "softmax" else scores / scores.sum(-1, keepdim=True)
        choice = scores if self.e_score_correction_bias is None else scores + self.e_score_correction_bias
        if self.n_groups > 1:
            n, e = choice.shape
            per = e // self.n_groups
            group_score = choice.view(n, self.n_groups, per).topk(min(2, per), dim=-1).values.sum(-1)
            keep = torch.zeros_like(group_score).scatter(1, group_score.topk(self.topk_groups, dim=-1).indices, 1.0)
            choice = choice.masked_fill(keep.repeat_interleave(per, dim=1) == 0, float("-inf"))
        ids = choice.topk(self.top_k, dim=-1).indices
        gates = scores.gather(1, ids)
        if self.norm_topk_prob and self.top_k > 1:
            gates = gates / gates.sum(-1, keepdim=True)
        gates = gates * self.route_scale
        n_tok = xf.shape[0]
        kept = [[True] * self.top_k for _ in range(n_tok)]
        if self.capacity_factor is not None:
            cap = max(1, min(n_tok, math.ceil(n_tok * self.top_k / self.n_experts * self.capacity_factor)))
            used = [0] * self.n_experts
            for j in range(self.top_k):
                for n in range(n_tok):
                    e = int(ids[n, j])
                    kept[n][j] = used[e] < cap
                    used[e] += 1
        # the experts one at a time over the rows that chose them (transformers' eager MoE loop):
        # each expert's rows in one GEMM, gate-weighted, added back to their tokens
        y = xf.new_zeros(xf.shape)
        for e in range(self.n_experts):
            pairs = [(n, j) for n in range(n_tok) for j in range(self.top_k) if kept[n][j] and int(ids[n, j]) == e]
            if not pairs:
                continue
            tok = torch.tensor([n for n, _j in pairs])
            choice = torch.tensor([j for _n, j in pairs])
            out = self.experts.expert(e, xf[tok]) * gates[tok, choice].to(xf.dtype).unsqueeze(1)
            y = y.index_add(0, tok, out)
        if self.shared_expert is not None:
            y = y + self.shared_expert(xf)
        frac = torch.stack([(ids == e).sum() for e in range(self.n_experts)]).float() / ids.numel()
        aux = self.aux_loss_weight * self.n_experts * (frac * probs.mean(0)).sum()
        return y.reshape(x.shape), aux


def plain_moe(model: nn.Module) -> nn.Module:
    """A copy of ``model`` in which every ``autopar.nn.MoE`` block is a ``PlainMoE`` holding
    copies of its parameters under the same names: the eager reference of the EP tests."""
    from autopar.nn import MoE

    ref = copy.deepcopy(model)
    for name, mod in list(ref.named_modules()):
        for child_name, child in list(mod.named_children()):
            if isinstance(child, MoE):
                setattr(mod, child_name, PlainMoE(child).to(next(child.parameters()).dtype))
    return ref


class EagerMuonAdamW:
    """The eager reference of ``autopar.Muon`` (design.md §5): ``torch.optim.Muon`` on the
    parameter groups whose ``muon`` option is true, ``torch.optim.AdamW`` on the others, each
    with the hyperparameters of an ``autopar.Muon`` factory (``spec``). Use it as
    ``eager_reference(..., optimizer_factory=EagerMuonAdamW.factory(spec), param_groups=lambda
    fqn, p: {"muon": routes[fqn].muon})``. A stack of matrices (experts ``[E, a, b]``) is
    stepped as E matrices: each a 2-D leaf of its own that ``torch.optim.Muon`` steps (values
    and gradients copied in before the step, values out after). ``spec.ns_dtype`` float32 runs
    torch's Newton-Schulz in float32 (its ``bfloat16()`` cast made a copy): bfloat16 rounds
    gradients that differ in their last fp32 bits apart (1e-3 after three steps between two
    eager runs that only accumulate microbatches in another order), float32 does not."""

    def __init__(self, groups, spec):
        groups, self.spec = list(groups), spec
        muon = [p for g in groups if g["muon"] for p in g["params"] if p.ndim == 2]
        self.stacks = [(p, [torch.zeros(p.shape[-2:], dtype=p.dtype) for _ in range(p[..., 0, 0].numel())])
                       for g in groups if g["muon"] for p in g["params"] if p.ndim > 2]
        muon += [m for _, ms in self.stacks for m in ms]
        other = [p for g in groups if not g["muon"] for p in g["params"]]
        self.optimizers = []
        if muon:
            self.optimizers.append(torch.optim.Muon(muon, lr=spec.lr, weight_decay=spec.weight_decay,
                                                    momentum=spec.momentum, nesterov=spec.nesterov,
                                                    ns_steps=spec.ns_steps, adjust_lr_fn=spec.adjust_lr_fn))
        if other:
            self.optimizers.append(torch.optim.AdamW(other, lr=spec.adamw_lr, betas=spec.adamw_betas,
                                                     eps=spec.adamw_eps, weight_decay=spec.adamw_weight_decay))

    @classmethod
    def factory(cls, spec):
        return lambda groups: cls(groups, spec)

    @torch.no_grad()
    def step(self):
        for p, ms in self.stacks:
            for m, value, grad in zip(ms, p.reshape(-1, *p.shape[-2:]), p.grad.reshape(-1, *p.shape[-2:])):
                m.copy_(value)
                m.grad = grad.clone()
        keep = self.spec.ns_dtype == torch.bfloat16
        with contextlib.nullcontext() if keep else mock.patch.object(torch.Tensor, "bfloat16", torch.Tensor.clone):
            for o in self.optimizers:
                o.step()
        for p, ms in self.stacks:
            p.copy_(torch.stack(ms).view(p.shape))

    def zero_grad(self, set_to_none: bool = True):
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)
        for p, _ in self.stacks:
            p.grad = None
