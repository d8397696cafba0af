"""Muon for the hidden matrices, AdamW for the rest: ``autopar.Muon`` (docs/training.md).

    pm = autopar.parallelize(model, batch, loss_fn, optimizer=autopar.Muon(lr=0.02))

Muon (Keller Jordan, 2024; Moonlight, arXiv 2502.16982) keeps one momentum buffer per matrix
and steps it by its Newton-Schulz orthogonalization, ``torch.optim.Muon``'s update exactly
(Nesterov momentum, the quintic iteration in bfloat16 (``ns_dtype``), decoupled weight decay, the learning rate
adjusted to the matrix shape by ``adjust_lr_fn``). The other parameters take AdamW
(``adamw_*``), as ``torch.optim.AdamW`` steps them.

Which parameter takes which is decided from the captured graph by
``passes/optimizer_routing.py`` (``Muon.options``): the weights used as a matmul operand in the
hidden layers get Muon; embeddings, the LM head, the expert routers, norms, biases and every
other parameter get AdamW. ``muon_params`` overrides it: FQN patterns (``fnmatch``) or
``(fqn, parameter) -> bool``. ``split_heads=True`` orthogonalizes a projection whose output is
reshaped into heads one head's rows at a time (GLM-5's "Muon split"); the head size is read
from the reshape.

``MuonAdamW`` is the ``torch.optim.Optimizer`` both live in. A parameter group is a Muon group
when its ``muon`` option is true; its ``lr``, ``weight_decay`` and ``eps`` are Muon's, an AdamW
group's are AdamW's (``adamw_lr`` ...), so an lr scheduler scales both. A Muon group's parameter
is a matrix, a stack of matrices (experts: every leading index one matrix), or, under ZeRO, a
flat shard holding whole matrices at the offsets its ``muon_matrices`` option lists (per
parameter, ``[(offset, shape), ...]``: passes/zero_layout.py places every matrix wholly in
one replica's shard); ``muon_rows`` > 0 orthogonalizes each block of that many rows alone.
Used directly on ``model.parameters()`` (no routing), 2-D parameters take Muon and the others
AdamW.
"""
from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass

import torch
from torch.optim.adam import adam

from autopar.passes.zero_layout import shard_matrices, whole_matrices  # noqa: F401 - part of autopar.muon's API

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # torch.optim.Muon's (Keller Jordan's quintic)


def newton_schulz(g: torch.Tensor, steps: int, coefficients=NS_COEFFICIENTS, eps: float = 1e-7,
                  dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The orthogonalized ``g`` (2-D), as ``torch.optim.Muon`` computes it: in ``dtype``
    (torch's: bfloat16), the wide orientation, normalized by the Frobenius norm, ``steps``
    quintic iterations."""
    a, b, c = coefficients
    x = g.to(dtype, copy=True)
    tall = g.size(0) > g.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=eps))
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def adjusted_lr(lr: float, adjust_lr_fn: str | None, shape) -> float:
    """``torch.optim.Muon``'s learning-rate adjustment for a matrix of ``shape`` (A, B)."""
    a, b = shape[0], shape[1]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return lr * math.sqrt(max(1.0, a / b))
    if adjust_lr_fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(a, b))
    raise ValueError(f"autopar.Muon: adjust_lr_fn must be None, 'original' or 'match_rms_adamw', got {adjust_lr_fn!r}")


# parameter-group options that describe where matrices lie in this plan's shards: a checkpoint
# neither saves nor restores them (another plan lays its shards out anew)
LAYOUT_OPTIONS = frozenset({"muon_matrices", "muon_tp"})



def matrix_blocks(shape, rows: int) -> list[tuple[int, int]]:
    """Row ranges ``[lo, hi)`` orthogonalized alone in a matrix of ``shape``: one block of
    ``rows`` rows each when ``rows`` divides the row count, else the whole matrix."""
    r = shape[0]
    if rows and 0 < rows < r and r % rows == 0:
        return [(lo, lo + rows) for lo in range(0, r, rows)]
    return [(0, r)]


def _gathered(block: torch.Tensor, group: str, shard) -> torch.Tensor:
    """The whole matrix from every tp rank's ``block`` (``shard``: passes.tensor_parallel.TpShard
    of this rank; ``group``: the tp process group's name)."""
    from autopar.collectives import comms

    parts = comms.all_gather_dim0(block.contiguous(), comms.process_group(group))
    return shard.whole(list(parts.chunk(shard.tp, 0)))


class MuonAdamW(torch.optim.Optimizer):
    """Muon groups (``muon=True``) and AdamW groups in one optimizer (module docstring)."""

    def __init__(self, params, lr: float = 0.02, momentum: float = 0.95, nesterov: bool = True,
                 weight_decay: float = 0.1, ns_steps: int = 5, adjust_lr_fn: str | None = None,
                 adamw_lr: float = 3e-4, adamw_betas=(0.9, 0.95), adamw_eps: float = 1e-8,
                 adamw_weight_decay: float = 0.1, eps: float = 1e-7, ns_coefficients=NS_COEFFICIENTS,
                 ns_dtype: torch.dtype = torch.bfloat16):
        if lr < 0 or adamw_lr < 0 or momentum < 0 or weight_decay < 0 or adamw_weight_decay < 0:
            raise ValueError(f"autopar.Muon: lr, adamw_lr, momentum and the weight decays must be >= 0, got "
                             f"lr={lr}, adamw_lr={adamw_lr}, momentum={momentum}, weight_decay={weight_decay}, "
                             f"adamw_weight_decay={adamw_weight_decay}")
        if not 0 < ns_steps < 100:
            raise ValueError(f"autopar.Muon: ns_steps must be in [1, 99], got {ns_steps}")
        adjusted_lr(1.0, adjust_lr_fn, (1, 1))  # checks the name
        self._kinds = {
            True: dict(lr=lr, weight_decay=weight_decay, eps=eps),
            False: dict(lr=adamw_lr, weight_decay=adamw_weight_decay, eps=adamw_eps, betas=tuple(adamw_betas)),
        }
        defaults = dict(lr=lr, weight_decay=weight_decay, eps=eps, momentum=momentum, nesterov=nesterov,
                        ns_steps=ns_steps, ns_coefficients=tuple(ns_coefficients), adjust_lr_fn=adjust_lr_fn,
                        ns_dtype=ns_dtype,
                        betas=tuple(adamw_betas), muon=None, muon_rows=0, muon_matrices=None)
        params = list(params)
        if params and not isinstance(params[0], dict):  # bare parameters: 2-D ones take Muon
            params = [{"params": [p for p in params if p.ndim == 2], "muon": True},
                      {"params": [p for p in params if p.ndim != 2], "muon": False}]
            params = [g for g in params if g["params"]]
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict) -> None:
        group = dict(param_group)
        ps = group["params"]
        ps = [ps] if isinstance(ps, torch.Tensor) else list(ps)
        if group.get("muon") is None:
            group["muon"] = all(p.ndim == 2 for p in ps)
        for k, v in self._kinds[bool(group["muon"])].items():
            group.setdefault(k, v)
        if group["muon"] and group.get("muon_matrices") is None:
            bad = [tuple(p.shape) for p in ps if p.ndim < 2]
            if bad:
                raise ValueError(f"autopar.Muon: a Muon group holds parameters with fewer than 2 dims {bad}; "
                                 "route them to AdamW (muon_params)")
        super().add_param_group(group)

    def __repr__(self) -> str:
        kinds = [("muon" if g["muon"] else "adamw", len(g["params"]), g["lr"]) for g in self.param_groups]
        text = f"MuonAdamW({', '.join(f'{k}: {n} tensors at lr {lr:g}' for k, n, lr in kinds)})"
        routes = getattr(self, "routes", None)
        return text + ("\n" + routing_table(routes) if routes else "")

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            (self._muon if group["muon"] else self._adamw)(group)
        return loss

    def _matrices(self, group: dict, i: int, p: torch.Tensor):
        """(offset into the flat parameter, 2-D shape) of every matrix parameter ``i`` holds."""
        layout = group.get("muon_matrices")
        return layout[i] if layout is not None else shard_matrices([p.shape], [0], 0, p.numel())

    def _muon(self, group: dict) -> None:
        lr, wd, momentum = group["lr"], group["weight_decay"], group["momentum"]
        for i, p in enumerate(group["params"]):
            if p.grad is None:
                continue
            grad = p.grad
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(grad, memory_format=torch.preserve_format)
            buf = state["momentum_buffer"]
            buf.lerp_(grad, 1 - momentum)
            update = grad.lerp(buf, momentum) if group["nesterov"] else buf
            flat_p, flat_u = p.view(-1), update.reshape(-1)
            tp = group.get("muon_tp")  # (tp group, TpShard): this rank holds a block of each matrix
            for offset, shape in self._matrices(group, i, p):
                n = shape[0] * shape[1]
                pm = flat_p[offset: offset + n].view(shape)
                um = flat_u[offset: offset + n].view(shape)
                if tp is not None:  # Newton-Schulz on the whole matrix, gathered over tp; this rank's block of it
                    pm.mul_(1 - lr * wd)
                    pm.add_(tp[1].local(self._orthogonalized(group, _gathered(um, *tp), lr)))
                    continue
                for lo, hi in matrix_blocks(shape, group["muon_rows"]):
                    o = newton_schulz(um[lo:hi], group["ns_steps"], group["ns_coefficients"], group["eps"],
                                      group["ns_dtype"])
                    block = pm[lo:hi]
                    block.mul_(1 - lr * wd)
                    block.add_(o, alpha=-adjusted_lr(lr, group["adjust_lr_fn"], (hi - lo, shape[1])))

    @staticmethod
    def _orthogonalized(group: dict, um: torch.Tensor, lr: float) -> torch.Tensor:
        """The step of one whole matrix's update ``um``: each block of ``muon_rows`` rows through
        Newton-Schulz, times minus its adjusted learning rate."""
        out = torch.empty_like(um)
        for lo, hi in matrix_blocks(tuple(um.shape), group["muon_rows"]):
            out[lo:hi] = newton_schulz(um[lo:hi], group["ns_steps"], group["ns_coefficients"], group["eps"],
                                       group["ns_dtype"]) * -adjusted_lr(lr, group["adjust_lr_fn"],
                                                                         (hi - lo, um.shape[1]))
        return out

    def _adamw(self, group: dict) -> None:
        """``torch.optim.AdamW``'s update: torch's functional Adam with decoupled weight decay
        (its per-tensor loop on CPU, foreach on CUDA, as AdamW picks)."""
        params = [p for p in group["params"] if p.grad is not None]
        for p in params:
            state = self.state[p]
            if not state:  # AdamW's state, under its names (checkpoints and load_state_dict)
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        beta1, beta2 = group["betas"]
        states = [self.state[p] for p in params]
        adam(params, [p.grad for p in params], [st["exp_avg"] for st in states], [st["exp_avg_sq"] for st in states],
             [], [st["step"] for st in states], decoupled_weight_decay=True, amsgrad=False, beta1=beta1,
             beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"], maximize=False)


@dataclass(frozen=True)
class Muon:
    """The optimizer factory (``parallelize(optimizer=autopar.Muon(...))``); calling it on
    parameters or parameter groups gives a ``MuonAdamW``. Defaults are ``torch.optim.Muon``'s
    and ``torch.optim.AdamW``'s where they have them (module docstring)."""

    lr: float = 0.02
    momentum: float = 0.95
    nesterov: bool = True
    weight_decay: float = 0.1
    ns_steps: int = 5
    adjust_lr_fn: str | None = None
    adamw_lr: float = 3e-4
    adamw_betas: tuple = (0.9, 0.95)
    adamw_eps: float = 1e-8
    adamw_weight_decay: float = 0.1
    muon_params: object = None
    split_heads: bool = False
    ns_dtype: torch.dtype = torch.bfloat16

    def __call__(self, params) -> MuonAdamW:
        return MuonAdamW(params, lr=self.lr, momentum=self.momentum, nesterov=self.nesterov,
                         weight_decay=self.weight_decay, ns_steps=self.ns_steps, adjust_lr_fn=self.adjust_lr_fn,
                         adamw_lr=self.adamw_lr, adamw_betas=self.adamw_betas, adamw_eps=self.adamw_eps,
                         adamw_weight_decay=self.adamw_weight_decay, ns_dtype=self.ns_dtype)

    def routes(self, captured) -> dict:
        """FQN -> ``Route`` for every parameter of ``captured`` (the graph's routing, then
        ``muon_params``, called with each parameter's shape)."""
        from autopar.passes.optimizer_routing import route_parameters

        routes = route_parameters(captured, split_heads=self.split_heads)
        if self.muon_params is None:
            return routes
        chosen = self.muon_params
        if callable(chosen):
            pick = chosen
        else:
            patterns = [chosen] if isinstance(chosen, str) else list(chosen)
            pick = lambda fqn, _shape: any(fnmatch.fnmatchcase(fqn, pat) for pat in patterns)  # noqa: E731
        out = {}
        for fqn, r in routes.items():
            if pick(fqn, r.shape):
                if len(r.shape) < 2:
                    raise ValueError(f"autopar.Muon: muon_params picks {fqn!r} of shape {r.shape}; "
                                     "Muon steps matrices (2 or more dims)")
                out[fqn] = r if r.muon else r._replace(muon=True, reason="muon_params")
            else:
                out[fqn] = r._replace(muon=False, reason="muon_params", rows=0) if r.muon else r
        return out


def route_options(routes: dict) -> dict[str, dict]:
    """FQN -> the parameter-group options a route puts it in."""
    return {f: ({"muon": True, "muon_rows": r.rows} if r.rows else {"muon": True}) if r.muon else {"muon": False}
            for f, r in routes.items()}


def routing_table(routes: dict) -> str:
    """The routing as a table: FQN, shape, optimizer, why."""
    rows = [(f, "x".join(map(str, r.shape)) or "scalar",
             ("muon" + (f" (blocks of {r.rows} rows)" if r.rows else "")) if r.muon else "adamw", r.reason)
            for f, r in routes.items()]
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h)
              for i, h in enumerate(("parameter", "shape", "optimizer", "why"))]
    lines = ["  ".join(h.ljust(w) for h, w in zip(("parameter", "shape", "optimizer", "why"), widths))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in rows]
    return "\n".join(lines)
