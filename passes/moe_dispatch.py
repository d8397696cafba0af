"""Token-proportional dropless MoE dispatch: the experts of one MoE block as one graph op.

``dropless_experts(x [N, d], ids [N, k], weights [N, k], params, key, group, ep, n_local)``
returns ``[N, d]``, ``sum_j weights[n, j] * expert_{ids[n, j]}(x[n])`` (the experts' own
contract: the weight is applied inside the experts' code), computed by the experts that this
rank and its ``ep - 1`` peers of the EP group hold (``n_local = E / ep`` each, expert ``e`` on
group rank ``e // n_local``). Its output shape is static (the block's), so it is one node of a
static captured graph; its inside is dynamic:

1. **count exchange**: every rank all-gathers the per-expert counts of its ``N * k``
   assignments (``[ep, E]`` int64), so every rank knows every receive size, and a receive
   bound fails on every rank at once, naming the layer and the counts;
2. **dispatch**: the assignments, sorted by expert (so by destination rank, then local expert),
   leave as rows of ``x`` (a token chosen twice by one rank's experts travels twice) with their
   routing weights, in one uneven ``all_to_all_single`` each: a rank receives exactly the rows
   routed to its experts, ``N * k`` on average over the group;
3. **local experts**: the experts' own code (a transformers implementation, the user's module,
   or ``GroupedExperts``' per-expert GEMMs over the sorted groups) runs on exactly those rows,
   ``k = 1`` per row, with the parameter values the graph passes (compute copies, ZeRO-3
   gathers), under a private autograd graph;
4. **combine**: the reverse uneven all-to-all returns every row to its token's rank, which sums
   each token's ``k`` rows in choice order, as the experts' implementations do.

Memory and traffic are the routed rows: per rank and MoE block, ``N * k`` rows of ``d`` each way
(plus the weights and the ``ep * E`` counts), and the experts' activations of the received rows,
instead of the ``ep * N * min(k, E/ep)`` rows of a worst-case static buffer.

**Three ops each way, so the all-to-alls can fly while other work runs.** The forward is
``moe_dispatch_send`` (counts exchanged, the rows' and weights' all-to-alls started),
``moe_dispatch_experts`` (waits for them, runs the local experts, starts the return) and
``moe_dispatch`` (waits, sums: the block's output, and the op that carries the autograd formula).
Captured, they follow each other; passes/moe_overlap.py spreads them over the program, around
the work that does not depend on them (a shared expert). A stage cut never falls inside a chain
(passes/split_stages.py: its handles are values in flight).

**Backward, split in two** (so the stage's I/W split holds; design.md §3):

* in I, ``moe_dispatch_grad_send`` -> ``moe_dispatch_grad_input`` -> ``moe_dispatch_grad_combine``:
  each assignment's output gradient (its token's) goes to the expert's rank by the forward's
  splits, the private graph gives the gradients of the received rows and weights only (no
  weight-gradient GEMM runs: autograd computes what the requested inputs need), and the reverse
  all-to-all returns them; the owner sums a token's rows;
* ``moe_dispatch_grad_weight`` (in W): the expert parameter gradients, with no communication. It
  builds each parameter's gradient from the outputs of the ops that consume it
  (``_ParameterConsumers``: recorded in F, their gradients kept by I's walk), so the
  activations' path is not walked again; a parameter reached both directly and through another
  consumer falls back to walking the private graph from its output.

In a fused backward (B: W right behind I, and eager autograd) the input-gradient op walks the
private graph once for every gradient and the weight-gradient op returns the parameters' share
(``fused_backward``).

What travels from F to I and W inside the graph is a scalar int64 *handle* (CPU) that carries
What travels from F to I and W inside the graph is a scalar int64 *handle* (CPU) that carries
its experts module's key; the dynamic state (received rows, the private graph, splits) lives
in that module's entry (``ExpertsEntry.states``), removed by W (or by I when no expert parameter
is trained). The entry belongs to the module (``module._autopar_dispatch``), and the ops find it
among the entries served where they run (collectives/moe_exchange.py ``serving``: the model's
ParallelModel serves its own around each step), never in a process-wide registry: two models in
one process never share states or statistics, and a freed model takes its entries with it. The
execution (count exchange, all-to-alls, buffers, the private graph, statistics) is
collectives/moe_exchange.py; this module defines the graph ops, their autograd formula and fake
kernels, the experts' registration, and what the planner reads of the ops (``routed_info``,
``dispatch_flops``). The state's bytes are what the planner prices per routed row.

With ``ep == 1`` (no group) no communication happens: a dropless single-process MoE.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Callable

import torch
import torch.fx as fx

from autopar.collectives import moe_exchange as ex
from autopar.collectives.moe_exchange import ExpertsEntry

from . import tp_ops  # noqa: F401 - the sp_split / sp_gather ops a folded dispatch inserts

log = logging.getLogger("autopar")

__all__ = ("register_experts", "dropless_experts", "routed_info", "RoutedInfo", "registered_names", "set_layer_name",
           "set_receive_policy", "module_runner", "probe_row_costs", "is_dispatch_node")


def _new_key() -> int:
    """A fresh 31-bit key for an experts module: random (no process-wide counter), non-zero; a
    collision among the entries served together is an error there (``moe_exchange.serving``)."""
    return int.from_bytes(os.urandom(4), "little") & 0x7FFFFFFF or 1


def register_experts(module, run: Callable, params: dict, layer: str, n_experts: int, d: int,
                     probe_experts: int | None = None) -> int:
    """Register an experts module's local runner ``run(params, rows [M, d], local ids [M],
    weights [M]) -> [M, d]`` over its parameters ``params`` (name -> tensor, in the order the op
    will take their values); returns the key ``dropless_experts`` takes. Its per-row FLOPs and
    saved bytes (what the planner prices) are measured here on fake tensors. The module keeps
    the key as ``_autopar_dispatch_key`` and owns the entry (``_autopar_dispatch``: its runner,
    receive ratios, statistics and dispatch states), so it dies with the model; copies of the
    module share the entry (the parameter values always come from the graph). ``probe_experts``:
    measure on the first that many experts only (a runner whose per-row cost does not depend on
    the expert count, such as ``GroupedExperts.run_rows``: 256 experts probe in ~1 s, 2 in
    milliseconds)."""
    first = next(iter(params.values()))
    probe = params if probe_experts is None else {n: p[:probe_experts] for n, p in params.items()}
    try:
        flops, saved = probe_row_costs(run, probe, d, int(next(iter(probe.values())).shape[0]), first.dtype)
    except Exception as e:  # noqa: BLE001 - the user's code on fake tensors: fall back to the weights' count
        flops = 2 * sum(p.numel() // max(int(p.shape[0]), 1) for p in params.values())
        saved = d + flops // (2 * max(d, 1))
        log.info("moe_dispatch: %s: per-row costs from its weights (%d FLOPs, %d saved elements a row): the fake "
                 "probe raised %s", layer, flops, saved, type(e).__name__)
    key = _new_key()
    spec = ExpertsEntry(run, tuple(params), layer, int(n_experts), flops, saved, key=key)
    module._autopar_dispatch = spec  # the module owns its entry
    module._autopar_dispatch_key = key
    return key


def set_layer_name(module, layer: str) -> None:
    module._autopar_dispatch.layer = layer


def registered_names(module) -> tuple[str, ...]:
    """The parameter names, in the order the op takes their values, of a registered module."""
    return module._autopar_dispatch.names


def module_runner(module, call: Callable) -> Callable:
    """A runner calling ``call(module, rows [M, d], local ids [M], weights [M])`` (an experts
    module's own code) with the module's parameters replaced by the values the graph passes."""
    from torch.nn.utils.stateless import _reparametrize_module

    def run(params, rows, local_ids, weights, _counts):
        with _reparametrize_module(module, params):
            return call(module, rows, local_ids, weights)

    return run


def probe_row_costs(run: Callable, params: dict, d: int, n_local: int, dtype: torch.dtype) -> tuple[int, int]:
    """(forward FLOPs, elements saved for backward) per routed row of a runner, measured on fake
    tensors as the difference between 2M and M rows (exact for experts that are linear in the
    row count, as every per-row expert is); ``params`` real or meta tensors (never read)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fake = {n: mode.from_tensor(p) for n, p in params.items()}
    rows = 4 * max(n_local, 1)
    costs = []
    compiling, torch.compiler._is_compiling_flag = torch.compiler._is_compiling_flag, True  # as under export
    try:
        costs = _probe_runs(run, mode, fake, d, n_local, dtype, rows)
    finally:
        torch.compiler._is_compiling_flag = compiling
    (f1, s1), (f2, s2) = costs
    return (f2 - f1) // rows, (s2 - s1) // rows + d  # + d: the received row, kept for W


def _probe_runs(run, mode, fake, d, n_local, dtype, rows):
    from torch.utils.flop_counter import FlopCounterMode

    costs = []
    for m in (rows, 2 * rows):
        saved = [0]

        def pack(t):  # the weights it saves cancel in the difference
            saved[0] += t.numel()
            return t

        with mode, FlopCounterMode(display=False) as counter, torch.enable_grad(), \
                torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            leaves = {n: p.detach().requires_grad_(p.is_floating_point()) for n, p in fake.items()}
            x = torch.empty(m, d, dtype=dtype).requires_grad_()
            w = torch.empty(m, dtype=dtype).requires_grad_()
            ids = torch.arange(m) % max(n_local, 1)
            run(leaves, x, ids, w, [m // max(n_local, 1)] * max(n_local, 1))
        costs.append((counter.get_total_flops(), saved[0]))
    return costs


def set_receive_policy(module, priced: float | None, limit: float | None = None) -> None:
    """The receive ratios (largest receive of one rank in one dispatch over the group's mean)
    of this experts module: ``priced``, what the plan's memory was priced at (a dispatch over it
    runs on, moving and allocating what the counts say, and logs a rate-limited warning);
    ``limit``, a hard limit set by the user (a dispatch over it fails with
    ``ReceiveBoundError`` on every rank of the group at once). None: neither."""
    for name, factor in (("moe_imbalance", priced), ("moe_receive_limit", limit)):
        if factor is not None and not factor >= 1:
            raise ValueError(f"autopar: {name}={factor!r}: a receive ratio is a multiple of the mean receive, >= 1")
    spec = module._autopar_dispatch
    spec.priced, spec.receive_bound = priced, limit




# -- the ops --------------------------------------------------------------------------------------------------------
# Forward: send (start) -> experts (wait; compute; start) -> moe_dispatch (wait; the output and its autograd).
# Backward (I): grad_send (start) -> grad_input (wait; compute; start) -> grad_combine (wait); W: grad_weight.
# Between a chain's ops other work of the step may run while the collectives fly (passes/moe_overlap.py).
def _handle_fake(*_args):
    return torch.empty((), dtype=torch.int64, device="cpu")


@torch.library.custom_op("autopar::moe_dispatch_send", mutates_args=())
def _moe_dispatch_send(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, key: int, group: str | None,
                       ep: int, n_local: int) -> torch.Tensor:
    return ex.send_rows(x, ids, weights, key, group, ep, n_local)


_moe_dispatch_send.register_fake(_handle_fake)


@torch.library.custom_op("autopar::moe_dispatch_experts", mutates_args=())
def _moe_dispatch_experts(handle: torch.Tensor, params: list[torch.Tensor], key: int, group: str | None,
                          ep: int, recompute: bool = False) -> torch.Tensor:
    return ex.run_experts(handle, params, key, group, ep, recompute)


_moe_dispatch_experts.register_fake(_handle_fake)


@torch.library.custom_op("autopar::moe_dispatch", mutates_args=())
def _moe_dispatch(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, params: list[torch.Tensor], key: int,
                  group: str | None, ep: int, n_local: int, handle: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return ex.combine_rows(x, ids, handle)


@_moe_dispatch.register_fake
def _(x, ids, weights, params, key, group, ep, n_local, handle):
    return x.new_empty(x.shape), _handle_fake()


@torch.library.custom_op("autopar::moe_dispatch_grad_send", mutates_args=())
def _moe_dispatch_grad_send(grad_y: torch.Tensor, handle: torch.Tensor, ids: torch.Tensor, group: str | None,
                            ep: int) -> torch.Tensor:
    return ex.send_grads(grad_y, handle, ids, group, ep)


_moe_dispatch_grad_send.register_fake(_handle_fake)


@torch.library.custom_op("autopar::moe_dispatch_grad_input", mutates_args=())
def _moe_dispatch_grad_input(handle: torch.Tensor, ids: torch.Tensor, params: list[torch.Tensor], key: int,
                             group: str | None, ep: int, last: bool) -> torch.Tensor:
    return ex.input_grads(handle, params, key, group, ep, last)


_moe_dispatch_grad_input.register_fake(_handle_fake)


@torch.library.custom_op("autopar::moe_dispatch_grad_combine", mutates_args=())
def _moe_dispatch_grad_combine(handle: torch.Tensor, grad_y: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                               last: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return ex.combine_grads(handle, grad_y, ids, weights, last)


@_moe_dispatch_grad_combine.register_fake
def _(handle, grad_y, ids, weights, last):
    return grad_y.new_empty(grad_y.shape), weights.new_empty(ids.shape), _handle_fake()


@torch.library.custom_op("autopar::moe_dispatch_grad_weight", mutates_args=())
def _moe_dispatch_grad_weight(handle: torch.Tensor, ids: torch.Tensor, params: list[torch.Tensor],
                              key: int) -> list[torch.Tensor]:
    return ex.weight_grads(handle, params)


@_moe_dispatch_grad_weight.register_fake
def _(handle, ids, params, key):
    return [p.new_empty(p.shape) for p in params]


def _setup(ctx, inputs, output):
    x, ids, weights, params, key, group, ep, n_local, _handle = inputs
    ctx.save_for_backward(output[1], ids, weights, *params)  # the parameters: W's op returns their shapes
    ctx.key, ctx.group, ctx.ep = key, group, ep
    ctx.served = ex.served()  # what the forward was served: the backward runs outside it
    ctx.mark_non_differentiable(output[1])


def _backward(ctx, grad_y, _grad_handle):
    handle, ids, weights, *params = ctx.saved_tensors
    need = ctx.needs_input_grad[3]
    want_params = bool(params) and (any(need) if isinstance(need, (list, tuple)) else bool(need))
    ops = torch.ops.autopar
    # eager autograd runs W right behind I (a traced graph ignores this: fake kernels)
    with ex.serving(ctx.served), ex.fused_backward():
        h = ops.moe_dispatch_grad_send(grad_y.contiguous(), handle, ids, ctx.group, ctx.ep)
        h = ops.moe_dispatch_grad_input(h, ids, params, ctx.key, ctx.group, ctx.ep, not want_params)
        grad_x, grad_w, token = ops.moe_dispatch_grad_combine(h, grad_y, ids, weights, not want_params)
        grad_params = ops.moe_dispatch_grad_weight(token, ids, params, ctx.key) if want_params \
            else [None] * len(params)
    return grad_x, None, grad_w, list(grad_params), None, None, None, None, None


_moe_dispatch.register_autograd(_backward, setup_context=_setup)

DISPATCH_OPS = (torch.ops.autopar.moe_dispatch.default,)  # the op with the block's output: what the planner reads
FORWARD_OPS = (torch.ops.autopar.moe_dispatch_send.default, torch.ops.autopar.moe_dispatch_experts.default,
               torch.ops.autopar.moe_dispatch.default)
BACKWARD_OPS = (torch.ops.autopar.moe_dispatch_grad_send.default, torch.ops.autopar.moe_dispatch_grad_input.default,
                torch.ops.autopar.moe_dispatch_grad_combine.default, torch.ops.autopar.moe_dispatch_grad_weight.default)
IN_FLIGHT_OPS = FORWARD_OPS[:2] + BACKWARD_OPS[:2]  # after these, an all-to-all is in flight




def dropless_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, params: list, experts,
                     group: str | None, ep: int, n_local: int, fold_group: str | None = None,
                     fold: int = 1) -> torch.Tensor:
    """The routed experts' output ``[N, d]`` (module docstring) of the registered module
    ``experts`` (``register_experts``; it serves its own entry while the ops run); ``params`` in
    the order it was registered with.

    ``fold > 1``: the experts are folded over the ``fold`` tensor-parallel ranks of the group
    ``fold_group``, which hold the same ``N`` rows: each routes only its block of ``N / fold``
    rows (``sp_split``: forward narrow, backward all-gather of the gradient) and the blocks'
    outputs are gathered whole again (``sp_gather``: forward all-gather, backward narrow; the
    replicated readers compute the same gradient on every tp rank), so every row goes through
    its experts once, on one rank, instead of once per tp rank."""
    if fold > 1:
        if x.shape[0] % fold:
            raise ValueError(f"autopar: experts folded over tp={fold} ranks split the MoE block's {x.shape[0]} rows "
                             f"(tokens of a microbatch) among them, which {fold} does not divide; make the "
                             f"microbatch's tokens a multiple of {fold}, or use ep=1 or tp=1 (experts not folded)")
        ops = torch.ops.autopar
        x, ids, weights = (ops.sp_split(t, fold_group, 0, fold) for t in (x, ids, weights))
        y = dropless_experts(x, ids, weights, params, experts, group, ep, n_local)
        return ops.sp_gather(y, fold_group, 0, fold)
    ops = torch.ops.autopar
    params = list(params)
    spec: ExpertsEntry = experts._autopar_dispatch
    key = spec.key
    with ex.serving({key: spec}):
        h = ops.moe_dispatch_send(x.detach(), ids, weights.detach(), key, group, ep, n_local)
        h = ops.moe_dispatch_experts(h, [p.detach() for p in params], key, group, ep)
        y, handle = ops.moe_dispatch(x, ids, weights, params, key, group, ep, n_local, h)
        if not torch.compiler.is_compiling() and not y.requires_grad:
            # eager with no backward to come (no_grad, evaluation): nothing will read the state
            ex.release(handle)
    return y


def is_dispatch_node(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in FORWARD_OPS + BACKWARD_OPS


# -- what the planner prices ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class RoutedInfo:
    """One MoE block's dispatch as the planner prices it (mean over the EP group, per microbatch)."""

    layer: str
    rows: int  # routed rows a rank sends (and, on average, receives): N * k
    row_bytes: int  # bytes of one dispatched row (d elements in the compute dtype)
    saved_row_bytes: int  # bytes kept from F until W per received row (the row + the experts' activations)
    flops_per_row: int  # forward FLOPs of one row through its expert
    # FLOPs of independent work the program runs while each of the chain's two all-to-alls is in
    # flight (passes/moe_overlap.py; zeros where the chain was not spread, e.g. a forward graph)
    overlap_f: tuple[int, int] = (0, 0)
    overlap_i: tuple[int, int] = (0, 0)


def routed_info(node: fx.Node) -> RoutedInfo | None:
    """``RoutedInfo`` of a ``moe_dispatch`` node (None for any other node)."""
    if node.op != "call_function" or node.target not in DISPATCH_OPS:
        return None
    x, ids = node.args[0].meta["val"], node.args[1].meta["val"]
    spec = ex.entry(node.args[4])
    item = x.element_size()
    rows = int(ids.numel())
    windows = node.meta.get("autopar_moe_overlap", {})
    return RoutedInfo(spec.layer, rows, int(x.shape[-1]) * item, spec.saved_row_elems * item, spec.flops_per_row,
                      tuple(windows.get("F", (0, 0))), tuple(windows.get("I", (0, 0))))


def dispatch_flops(target, args) -> int | None:
    """FLOPs of a call of one of the dispatch ops (``args``: its arguments, fake or real) at the
    mean routing, or None for another op: the forward's rows through their experts (on the
    op with the block's output); the input-gradient op the same again (the input-gradient
    GEMMs); the weight-gradient op the same again plus the re-walk of the private graph's path
    (module docstring), counted as half the forward's; the chain's other ops none (they move
    rows)."""
    if target in DISPATCH_OPS:
        ids, key = args[1], args[4]
    elif target is BACKWARD_OPS[1]:
        ids, key = args[1], args[3]
    elif target is BACKWARD_OPS[3]:
        return int(args[1].numel()) * ex.entry(args[3]).flops_per_row * 3 // 2
    elif target in FORWARD_OPS + BACKWARD_OPS:
        return 0
    else:
        return None
    return int(ids.numel()) * ex.entry(key).flops_per_row
