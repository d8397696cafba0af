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
its experts module's key; the dynamic state (received rows, the private graph, splits) lives
in that module's entry (``_Experts.states``), removed by W (or by I when no expert parameter is
trained). The entry belongs to the module (``module._autopar_dispatch``); the registry that
finds it by key is weak, so two models in one process never share states or statistics and a
freed model takes its entries with it. ``clear(keys)`` drops what a failed step of one model
left behind. The state's bytes are what the planner prices per routed row (``routed_info``);
``receive_stats(keys)`` is the largest receive since the last ``reset_stats(keys)`` against the
mean, for ``pm.metrics``.

With ``ep == 1`` (no group) no communication happens: a dropless single-process MoE.
"""
from __future__ import annotations

import contextlib
import itertools
import logging
import time
import weakref
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.fx as fx

log = logging.getLogger("autopar")

__all__ = ["register_experts", "dropless_experts", "routed_info", "RoutedInfo", "receive_stats", "reset_stats",
           "clear", "set_receive_policy", "registered_names", "set_layer_name", "module_runner", "probe_row_costs",
           "live_handles", "is_dispatch_node", "ReceiveBoundError", "fused_backward"]


class ReceiveBoundError(RuntimeError):
    """A rank would receive more routed rows than the hard limit the user set for its MoE layer."""


# a dispatch over the priced ratio logs at most once per this many seconds per layer (with the
# number of such dispatches since the last line)
WARN_EVERY_S = 60.0


@dataclass
class _Receives:
    """What one experts module's dispatches received since its last reset (``pm.metrics``)."""

    max_rows: int = 0  # the largest receive of one rank in one dispatch
    rows: float = 0.0  # the sum of the per-dispatch mean receives
    calls: int = 0  # dispatches
    over: int = 0  # dispatches whose largest receive exceeded the priced ratio


@dataclass
class _Experts:
    """One registered experts module: how to run its local experts on received rows."""

    run: Callable  # (params {name: tensor}, rows [M, d], local ids [M], weights [M], rows per local expert) -> [M, d]
    names: tuple[str, ...]  # parameter names, in the order the op receives their values
    layer: str  # the block's FQN, for errors and metrics
    n_experts: int  # global E
    flops_per_row: int  # forward FLOPs of one row through one expert (2 * elements of one expert)
    saved_row_elems: int  # elements saved from F to W per received row (row + expert activations)
    receive_bound: float | None = None  # hard limit: most received rows, a multiple of the mean (None: none)
    priced: float | None = None  # the ratio the plan's memory was priced at: above it, a warning
    stats: _Receives = field(default_factory=_Receives)
    warned_at: float = float("-inf")  # time.monotonic() of the last over-priced warning
    unwarned: int = 0  # over-priced dispatches since that warning
    states: dict = field(default_factory=dict)  # handle -> _State: this module's dispatches in flight

    def __deepcopy__(self, memo):
        return self  # copies of an experts module share its entry (the graph passes the values)


# key -> the entry its experts module holds (``module._autopar_dispatch``): weak, so an entry, its
# dispatch states and statistics live exactly as long as the model that owns them. The graph ops
# find their module's entry by the key they carry; a handle carries its key in its high bits.
_REGISTRY: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_KEYS = itertools.count(1)
_HANDLES = itertools.count(1)
_KEY_SHIFT = 32


@dataclass
class _State:
    layer: str
    order: torch.Tensor  # [S] sorted position -> assignment (token * k + choice)
    send: list[int]  # rows sent to each group rank
    recv: list[int]  # rows received from each group rank
    local_ids: torch.Tensor  # local expert of every received row
    local_counts: list[int]  # received rows per local expert
    pending: list = field(default_factory=list)  # async collectives in flight (work handles)
    buffers: dict = field(default_factory=dict)  # what they read and write, alive until waited on
    rows: torch.Tensor | None = None  # received rows (leaf of the private graph)
    weights: torch.Tensor | None = None  # received routing weights (leaf)
    params: list = field(default_factory=list)  # parameter leaves of the private graph
    out: torch.Tensor | None = None  # the local experts' output on the received rows
    grad_rows: torch.Tensor | None = None  # set by I: the output gradients W needs
    recompute: bool = False  # F kept only the rows and weights: I runs the experts again
    extra: dict = field(default_factory=dict)

    def release(self) -> None:
        """Break the cycle the consumers' tensor hooks make (hook -> consumers -> their outputs ->
        hook, through autograd's C++ side, which the garbage collector does not see)."""
        consumers = self.extra.pop("consumers", None)
        if consumers is not None:
            consumers.found, consumers.grads = [], {}

    def wait(self) -> dict:
        """Finish the collectives in flight; their buffers."""
        for w in self.pending:
            w.wait()
        self.pending = []
        out, self.buffers = self.buffers, {}
        return out




def _entry(key: int) -> _Experts:
    spec = _REGISTRY.get(key)
    if spec is None:
        raise RuntimeError(f"autopar: MoE dispatch key {key}: its experts module is gone (the model that registered "
                           "it was freed while a graph that runs it is still in use)")
    return spec


def _release(handle) -> None:
    _state(handle, pop=True).release()


def _state(handle, pop: bool = False) -> _State:
    h = int(handle)
    states = _entry(h >> _KEY_SHIFT).states
    return states.pop(h) if pop else states[h]
_FUSED = [False]  # a fused backward (B) runs: the input-gradient op computes the weight gradients too


@contextlib.contextmanager
def fused_backward():
    """While a fused backward (B: I and W of one microbatch back to back) runs: the
    input-gradient op walks the experts' private graph once for the rows', routing weights'
    and parameters' gradients together, and the weight-gradient op returns the latter; under a
    split backward (W deferred) they are the two walks of the module docstring."""
    prev, _FUSED[0] = _FUSED[0], True
    try:
        yield
    finally:
        _FUSED[0] = prev


def register_experts(module, run: Callable, params: dict, layer: str, n_experts: int, d: int,
                     probe_experts: int | None = None) -> int:
    """Register an experts module's local runner ``run(params, rows [M, d], local ids [M],
    weights [M]) -> [M, d]`` over its parameters ``params`` (name -> tensor, in the order the op
    will take their values); returns the key ``dropless_experts`` takes. Its per-row FLOPs and
    saved bytes (what the planner prices) are measured here on fake tensors. The module keeps
    the key as ``_autopar_dispatch_key`` and owns the entry (``_autopar_dispatch``: its runner,
    receive ratios, statistics and dispatch states), which the registry holds weakly, so it
    dies with the model; copies of the module share the entry (the parameter values always
    come from the graph). ``probe_experts``: measure on the first that
    many experts only (a runner whose per-row cost does not depend on the expert count, such as
    ``GroupedExperts.run_rows``: 256 experts probe in ~1 s, 2 in milliseconds)."""
    first = next(iter(params.values()))
    probe = params if probe_experts is None else {n: p[:probe_experts] for n, p in params.items()}
    try:
        flops, saved = probe_row_costs(run, probe, d, int(next(iter(probe.values())).shape[0]), first.dtype)
    except Exception as e:  # noqa: BLE001 - the user's code on fake tensors: fall back to the weights' count
        flops = 2 * sum(p.numel() // max(int(p.shape[0]), 1) for p in params.values())
        saved = d + flops // (2 * max(d, 1))
        log.info("moe_dispatch: %s: per-row costs from its weights (%d FLOPs, %d saved elements a row): the fake "
                 "probe raised %s", layer, flops, saved, type(e).__name__)
    key = next(_KEYS)
    spec = _Experts(run, tuple(params), layer, int(n_experts), flops, saved)
    _REGISTRY[key] = spec
    module._autopar_dispatch = spec  # the module owns its entry (the registry only finds it)
    module._autopar_dispatch_key = key
    return key


def set_layer_name(module, layer: str) -> None:
    _entry(module._autopar_dispatch_key).layer = layer


def registered_names(module) -> tuple[str, ...]:
    """The parameter names, in the order the op takes their values, of a registered module."""
    return _entry(module._autopar_dispatch_key).names


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
    spec = _entry(module._autopar_dispatch_key)
    spec.priced, spec.receive_bound = priced, limit


def _specs(keys) -> list[_Experts]:
    return list(_REGISTRY.values()) if keys is None else [_REGISTRY[k] for k in keys if k in _REGISTRY]


def receive_stats(keys=None) -> dict:
    """Over the experts modules ``keys`` (None: all): the largest receive (rows) of one rank in
    one dispatch since ``reset_stats()``, the mean receive per dispatch, their ratio, the layer
    of the largest, the dispatches, and how many of them went over their priced ratio."""
    specs = _specs(keys)
    calls = sum(sp.stats.calls for sp in specs)
    mean = sum(sp.stats.rows for sp in specs) / calls if calls else 0.0
    worst = max(specs, key=lambda sp: sp.stats.max_rows, default=None)
    top = worst.stats.max_rows if worst is not None else 0
    return {"max_rows": top, "mean_rows": mean, "ratio": top / mean if mean else 0.0,
            "layer": worst.layer if worst is not None and top else "", "dispatches": calls,
            "over_priced": sum(sp.stats.over for sp in specs)}


def reset_stats(keys=None) -> None:
    for sp in _specs(keys):
        sp.stats = _Receives()


def clear(keys=None) -> None:
    """Drop the live dispatch states (what a failed or forward-only step left behind) of the
    experts modules ``keys`` (None: of every model in this process)."""
    for spec in _specs(keys):
        for st in spec.states.values():
            st.release()
        spec.states.clear()


def live_handles(keys=None) -> int:
    """Dispatch states in flight of the experts modules ``keys`` (None: of every model)."""
    return sum(len(spec.states) for spec in _specs(keys))


@contextlib.contextmanager
def _autograd_inside():
    """Autograd inside a custom op's kernel (the dispatcher runs it below the autograd keys)."""
    dk = torch._C.DispatchKey
    keys = [dk.AutogradCPU, dk.AutogradCUDA, dk.ADInplaceOrView, dk.AutogradFunctionality]
    prev = [torch._C._dispatch_tls_is_dispatch_key_excluded(k) for k in keys]
    try:
        for k in keys:
            torch._C._dispatch_tls_set_dispatch_key_excluded(k, False)
        with torch.enable_grad():
            yield
    finally:
        for k, v in zip(keys, prev):
            torch._C._dispatch_tls_set_dispatch_key_excluded(k, v)


def _group(name: str | None):
    from torch.distributed import distributed_c10d as c10d

    return c10d._resolve_process_group(name)


def _all_to_all(st: "_State", name: str, t: torch.Tensor, recv: list[int], send: list[int], group) -> None:
    """Start an uneven all-to-all of ``t``'s rows; its result is ``st.wait()[name]``. Without a
    group (ep = 1) the rows stay."""
    if group is None:
        st.buffers[name] = t
        return
    import torch.distributed as dist

    src = t.contiguous()
    out = t.new_empty((sum(recv),) + tuple(t.shape[1:]))
    st.pending.append(dist.all_to_all_single(out, src, recv, send, group=group, async_op=True))
    st.buffers[name], st.buffers["_src_" + name] = out, src


def _exchange_counts(counts: torch.Tensor, group, ep: int) -> torch.Tensor:
    """``[ep, E]``: row ``i`` the per-expert assignment counts of group rank ``i``."""
    if ep == 1:
        return counts.unsqueeze(0)
    import torch.distributed as dist

    out = counts.new_empty(ep * counts.numel())
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # (the name before torch 2.13)
    gather(out, counts, group=group)
    return out.view(ep, counts.numel())


def _check_bound(spec: _Experts, table: torch.Tensor, ep: int, n_local: int, row_bytes: int = 0) -> list[int]:
    """Rows each group rank receives (``table [ep, E]``); records the stats. Over the priced
    ratio: a rate-limited warning, and the dispatch goes on (a dropless MoE must not stop a run
    because routing is skewed early in training). Over the user's hard limit:
    ReceiveBoundError, on every rank of the group (each sees the same table). ``row_bytes``:
    what one received row costs until W (for the warning's extra bytes)."""
    per_rank = table.view(ep, ep, n_local).sum(dim=(0, 2)).tolist()  # destination rank -> rows
    mean = sum(per_rank) / ep
    worst = max(per_rank)
    st = spec.stats
    st.calls += 1
    st.rows += mean
    st.max_rows = max(st.max_rows, worst)
    who = per_rank.index(worst)
    if spec.receive_bound is not None and worst > spec.receive_bound * mean:
        raise ReceiveBoundError(
            f"autopar: MoE layer {spec.layer}: EP group rank {who} would receive {worst} routed rows, "
            f"{worst / mean:.2f}x the mean {mean:.1f} (per-rank receives {per_rank}), over the hard limit of "
            f"{spec.receive_bound}x the mean set by Plan.moe_receive_limit; raise or remove the limit (a dropless "
            "dispatch runs at any imbalance), use more balanced routing (a load-balance loss or selection bias), or "
            "a static-capacity MoE that drops the overflow")
    if spec.priced is not None and worst > spec.priced * mean:
        st.over += 1
        spec.unwarned += 1
        now = time.monotonic()
        if now - spec.warned_at >= WARN_EVERY_S:
            extra = (worst - spec.priced * mean) * row_bytes
            log.warning("autopar: MoE layer %s: EP group rank %d received %d routed rows, %.2fx the mean %.1f "
                        "(per-rank %s), over the %gx the plan's memory was priced for: %.1f MiB more than priced "
                        "on that rank (%d such dispatch(es) in this layer since the last warning; pm.metrics "
                        "moe_over_priced counts them). The run goes on; if memory runs short, plan with a larger "
                        "moe_imbalance or balance the routing", spec.layer, who, worst, worst / mean, mean, per_rank,
                        spec.priced, extra / 2**20, spec.unwarned)
            spec.warned_at, spec.unwarned = now, 0
    return per_rank


def _send(x, ids, weights, key, group, ep, n_local):
    """Dispatch, started: counts exchanged (and the bound checked), the rows and their routing
    weights on their way (async); a new handle."""
    spec = _entry(key)
    k = ids.shape[1]
    pg = _group(group) if ep > 1 else None
    me = pg.rank() if pg is not None else 0
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # by expert: by destination rank, then local expert
    counts = torch.bincount(flat, minlength=ep * n_local)
    table = _exchange_counts(counts, pg, ep)  # [source rank, expert]
    _check_bound(spec, table, ep, n_local, row_bytes=spec.saved_row_elems * x.element_size())
    per_dest = table.view(ep, ep, n_local)
    mine = per_dest[:, me]  # [source rank, local expert]: the rows this rank receives
    # local expert of every received row: source-major, then expert-major within a source
    local_ids = torch.repeat_interleave(torch.arange(n_local, device=x.device).repeat(ep), mine.reshape(-1))
    st = _State(spec.layer, order, per_dest[me].sum(dim=1).tolist(), mine.sum(dim=1).tolist(), local_ids,
                mine.sum(dim=0).tolist())
    _all_to_all(st, "rows", x.index_select(0, torch.div(order, k, rounding_mode="floor")), st.recv, st.send, pg)
    _all_to_all(st, "weights", weights.reshape(-1).index_select(0, order), st.recv, st.send, pg)
    handle = (key << _KEY_SHIFT) | next(_HANDLES)
    spec.states[handle] = st
    return torch.tensor(handle, dtype=torch.int64)


def _experts(handle, params, key, group, ep, recompute):
    """The received rows through the local experts (private autograd graph; with ``recompute``
    none: only the rows and their weights are kept, and I runs the experts again); the
    combine started."""
    spec, st = _entry(key), _state(handle)
    got = st.wait()
    if recompute:
        with torch.no_grad():
            out = _call(spec, st, params, got["rows"], got["weights"])
        st.rows, st.weights, st.recompute = got["rows"], got["weights"], True
    else:
        out = _private_graph(spec, st, params, got["rows"], got["weights"])
    _all_to_all(st, "back", out.detach(), st.send, st.recv, _group(group) if ep > 1 else None)
    return torch.tensor(int(handle), dtype=torch.int64)


def _call(spec, st, params, rows, w):
    if rows.shape[0]:
        out = spec.run(dict(zip(spec.names, params)), rows, st.local_ids, w, st.local_counts)
    else:
        out = rows.new_zeros(rows.shape)
    if out.shape != rows.shape:
        raise ValueError(f"autopar: the experts of MoE layer {spec.layer} returned {tuple(out.shape)} for "
                         f"{tuple(rows.shape)} received rows, expected {tuple(rows.shape)}")
    return out


def _private_graph(spec, st, params, rows, w):
    """The experts on the received rows under their own autograd graph, kept in ``st``."""
    with _autograd_inside():
        rows = rows.detach().requires_grad_(True)
        w = w.detach().requires_grad_(True)
        leaves = [p.detach().requires_grad_(True) for p in params]
        consumers = _ParameterConsumers(leaves)
        with consumers:
            out = _call(spec, st, leaves, rows, w)
    st.rows, st.weights, st.params, st.out = rows, w, leaves, out
    st.extra["consumers"] = consumers.hooked() if rows.shape[0] else None
    return out


def _combine(x, ids, handle):
    """Every row back at its token's rank: each token's k rows summed in choice order."""
    st = _state(handle)
    back = st.wait()["back"]
    n, k = ids.shape
    per_assignment = torch.empty_like(back).index_copy_(0, st.order, back)
    return per_assignment.view(n, k, x.shape[1]).sum(dim=1).to(x.dtype), torch.tensor(int(handle), dtype=torch.int64)


def _grad_send(grad_y, handle, ids, group, ep):
    """I, started: each assignment's output gradient (its token's) on its way to the expert's rank."""
    st = _state(handle)
    k = ids.shape[1]
    g_send = grad_y.index_select(0, torch.div(st.order, k, rounding_mode="floor")).to(st.rows.dtype)
    _all_to_all(st, "grad_rows", g_send, st.recv, st.send, _group(group) if ep > 1 else None)
    return torch.tensor(int(handle), dtype=torch.int64)


def _grad_input(handle, params, key, group, ep, last):
    """The received rows' and routing weights' gradients (and, in a fused backward, the
    parameters'); their return started. A recomputing dispatch first runs its experts again."""
    st = _state(handle)
    if st.recompute:
        _private_graph(_entry(key), st, params, st.rows, st.weights)
    g_rows = st.wait()["grad_rows"]
    fuse = _FUSED[0] and not last and bool(st.params)
    with _autograd_inside():
        if not st.out.numel():
            gx = gw = None
        elif fuse:  # W right behind: one walk for every gradient (module docstring)
            if st.extra.get("consumers") is not None:
                st.extra["consumers"].active = False
            gx, gw, *gp = torch.autograd.grad(st.out, [st.rows, st.weights, *st.params], g_rows, allow_unused=True)
            st.extra["param_grads"] = gp
            st.release()
        else:
            gx, gw = torch.autograd.grad(st.out, [st.rows, st.weights], g_rows, retain_graph=not last,
                                         allow_unused=True)
    if not fuse:
        st.grad_rows = g_rows
    pg = _group(group) if ep > 1 else None
    _all_to_all(st, "gx", torch.zeros_like(st.rows) if gx is None else gx, st.send, st.recv, pg)
    _all_to_all(st, "gw", torch.zeros_like(st.weights) if gw is None else gw, st.send, st.recv, pg)
    return torch.tensor(int(handle), dtype=torch.int64)


def _grad_combine(handle, grad_y, ids, weights, last):
    """The tokens' and routing weights' gradients: each token's rows summed."""
    st = _state(handle, pop=last)
    got = st.wait()
    if last:
        st.release()
    n, k = ids.shape
    grad_x = grad_y.new_zeros(grad_y.shape).index_add_(0, torch.div(st.order, k, rounding_mode="floor"),
                                                       got["gx"].to(grad_y.dtype))
    grad_w = weights.new_zeros(n * k).index_copy_(0, st.order, got["gw"].to(weights.dtype)).view(n, k)
    return grad_x, grad_w, torch.tensor(int(handle), dtype=torch.int64)


def _grad_weight(handle, params):
    st = _state(handle, pop=True)
    consumers = st.extra.get("consumers")
    with _autograd_inside():
        if not (st.out.numel() and st.params):
            grads = [None] * len(st.params)
        elif "param_grads" in st.extra:  # computed by a fused backward's input-gradient op
            grads = st.extra["param_grads"]
        elif consumers is not None and consumers.complete():
            grads = consumers.weight_grads(st.params)
        else:  # walk the private graph again from its output
            grads = torch.autograd.grad(st.out, st.params, st.grad_rows, allow_unused=True)
    st.release()
    return [torch.zeros_like(p) if g is None else g.to(p.dtype) for g, p in zip(grads, params)]


class _ParameterConsumers(torch.overrides.TorchFunctionMode):
    """While the local experts run: which ops *consume* a parameter (take a value derived from
    parameters only -- the parameter, a view, ``W[e]``, ``W[idx]`` -- together with a value
    derived from the rows), and which parameters each reaches. I captures the gradient of every
    consumer's output on its way to the rows (tensor hooks); W then computes each parameter's
    gradient from its consumers' outputs only (one short backward per consumer: its own op and
    the parameter views), never walking the activations' path again. A parameter reached both
    directly and through another consumer's output (a double count) falls back to the full walk."""

    def __init__(self, leaves):
        super().__init__()
        from torch.utils.weak import WeakIdKeyDictionary

        self.index = {id(p): i for i, p in enumerate(leaves)}
        self.params_of: WeakIdKeyDictionary = WeakIdKeyDictionary()  # param-only tensor -> parameter indices
        self.reaches: WeakIdKeyDictionary = WeakIdKeyDictionary()  # any tensor -> parameter indices upstream
        self.found: list = []  # (consumer output, parameter indices)
        self.grads: dict[int, torch.Tensor] = {}
        self.ambiguous = False
        for p in leaves:
            self.params_of[p] = frozenset({self.index[id(p)]})
            self.reaches[p] = self.params_of[p]

    def __torch_function__(self, func, types, args=(), kwargs=None):
        from torch.utils._pytree import tree_leaves

        out = func(*args, **(kwargs or {}))
        tensors = [t for t in tree_leaves((args, kwargs or {})) if isinstance(t, torch.Tensor)]
        derived = [t for t in tensors if t in self.params_of]
        others = [t for t in tensors if t not in self.params_of and (t.requires_grad or t in self.reaches)]
        outs = [o for o in tree_leaves(out) if isinstance(o, torch.Tensor) and o.requires_grad]
        mine = frozenset().union(*(self.params_of[t] for t in derived)) if derived else frozenset()
        upstream = frozenset().union(*(self.reaches.get(t, frozenset()) for t in others)) if others else frozenset()
        for o in outs:
            if derived and not others:
                self.params_of[o] = mine
            if mine or upstream:
                self.reaches[o] = mine | upstream
        if derived and others:
            if mine & upstream:
                self.ambiguous = True
            self.found += [(o, mine) for o in outs]
        return out

    def hooked(self) -> "_ParameterConsumers":
        """Register the hooks that keep each consumer output's gradient (computed by I)."""
        self.active = True
        for k, (o, _mine) in enumerate(self.found):
            o.register_hook(lambda g, k=k: self.grads.__setitem__(k, g) if self.active else None)
        self.params_of = self.reaches = None  # the weak maps are no longer needed
        return self

    def complete(self) -> bool:
        return not self.ambiguous and bool(self.found) and len(self.grads) == len(self.found)

    def weight_grads(self, leaves: list) -> list:
        """One backward per set of parameters, from all the consumers that reach exactly it (no
        consumer of a set lies upstream of another one reaching the same parameter: that case is
        ``ambiguous``)."""
        total: list = [None] * len(leaves)
        by_set: dict[frozenset, list[int]] = {}
        for k, (_o, mine) in enumerate(self.found):
            by_set.setdefault(mine, []).append(k)
        for mine, ks in by_set.items():
            idx = sorted(mine)
            parts = torch.autograd.grad([self.found[k][0] for k in ks], [leaves[i] for i in idx],
                                        [self.grads[k] for k in ks], retain_graph=True, allow_unused=True)
            for i, g in zip(idx, parts):
                if g is not None:
                    total[i] = g if total[i] is None else total[i] + g
        return total


# -- the ops --------------------------------------------------------------------------------------------------------
# Forward: send (start) -> experts (wait; compute; start) -> moe_dispatch (wait; the output and its autograd).
# Backward (I): grad_send (start) -> grad_input (wait; compute; start) -> grad_combine (wait); W: grad_weight.
# Between a chain's ops other work of the step may run while the collectives fly (passes/moe_overlap.py).
def _handle_fake(*_args):
    return torch.empty((), dtype=torch.int64, device="cpu")


@torch.library.custom_op("autopar::moe_dispatch_send", mutates_args=())
def _moe_dispatch_send(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, key: int, group: str | None,
                       ep: int, n_local: int) -> torch.Tensor:
    return _send(x, ids, weights, key, group, ep, n_local)


_moe_dispatch_send.register_fake(_handle_fake)


@torch.library.custom_op("autopar::moe_dispatch_experts", mutates_args=())
def _moe_dispatch_experts(handle: torch.Tensor, params: list[torch.Tensor], key: int, group: str | None,
                          ep: int, recompute: bool = False) -> torch.Tensor:
    return _experts(handle, params, key, group, ep, recompute)


_moe_dispatch_experts.register_fake(_handle_fake)


@torch.library.custom_op("autopar::moe_dispatch", mutates_args=())
def _moe_dispatch(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, params: list[torch.Tensor], key: int,
                  group: str | None, ep: int, n_local: int, handle: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _combine(x, ids, handle)


@_moe_dispatch.register_fake
def _(x, ids, weights, params, key, group, ep, n_local, handle):
    return x.new_empty(x.shape), _handle_fake()


@torch.library.custom_op("autopar::moe_dispatch_grad_send", mutates_args=())
def _moe_dispatch_grad_send(grad_y: torch.Tensor, handle: torch.Tensor, ids: torch.Tensor, group: str | None,
                            ep: int) -> torch.Tensor:
    return _grad_send(grad_y, handle, ids, group, ep)


_moe_dispatch_grad_send.register_fake(_handle_fake)


@torch.library.custom_op("autopar::moe_dispatch_grad_input", mutates_args=())
def _moe_dispatch_grad_input(handle: torch.Tensor, ids: torch.Tensor, params: list[torch.Tensor], key: int,
                             group: str | None, ep: int, last: bool) -> torch.Tensor:
    return _grad_input(handle, params, key, group, ep, last)


_moe_dispatch_grad_input.register_fake(_handle_fake)


@torch.library.custom_op("autopar::moe_dispatch_grad_combine", mutates_args=())
def _moe_dispatch_grad_combine(handle: torch.Tensor, grad_y: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                               last: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _grad_combine(handle, grad_y, ids, weights, last)


@_moe_dispatch_grad_combine.register_fake
def _(handle, grad_y, ids, weights, last):
    return grad_y.new_empty(grad_y.shape), weights.new_empty(ids.shape), _handle_fake()


@torch.library.custom_op("autopar::moe_dispatch_grad_weight", mutates_args=())
def _moe_dispatch_grad_weight(handle: torch.Tensor, ids: torch.Tensor, params: list[torch.Tensor],
                              key: int) -> list[torch.Tensor]:
    return _grad_weight(handle, params)


@_moe_dispatch_grad_weight.register_fake
def _(handle, ids, params, key):
    return [p.new_empty(p.shape) for p in params]


def _setup(ctx, inputs, output):
    x, ids, weights, params, key, group, ep, n_local, _handle = inputs
    ctx.save_for_backward(output[1], ids, weights, *params)  # the parameters: W's op returns their shapes
    ctx.key, ctx.group, ctx.ep = key, group, ep
    ctx.mark_non_differentiable(output[1])


def _backward(ctx, grad_y, _grad_handle):
    handle, ids, weights, *params = ctx.saved_tensors
    need = ctx.needs_input_grad[3]
    want_params = bool(params) and (any(need) if isinstance(need, (list, tuple)) else bool(need))
    ops = torch.ops.autopar
    with fused_backward():  # eager autograd runs W right behind I (a traced graph ignores this: fake kernels)
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


def dropless_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, params: list, key: int,
                     group: str | None, ep: int, n_local: int) -> torch.Tensor:
    """The routed experts' output ``[N, d]`` (module docstring); ``params`` in the order the
    module was registered with."""
    ops = torch.ops.autopar
    params = list(params)
    h = ops.moe_dispatch_send(x.detach(), ids, weights.detach(), key, group, ep, n_local)
    h = ops.moe_dispatch_experts(h, [p.detach() for p in params], key, group, ep)
    y, handle = ops.moe_dispatch(x, ids, weights, params, key, group, ep, n_local, h)
    if not torch.compiler.is_compiling() and not y.requires_grad:
        # eager with no backward to come (no_grad, evaluation): nothing will read the state
        _release(handle)
    return y


def is_dispatch_node(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in FORWARD_OPS + BACKWARD_OPS


# the position of the experts module's key among each op's arguments
_KEY_ARG = {FORWARD_OPS[0]: 3, FORWARD_OPS[1]: 2, FORWARD_OPS[2]: 4, BACKWARD_OPS[1]: 3, BACKWARD_OPS[3]: 3}


def pin_entries(gm: fx.GraphModule) -> None:
    """Every dispatch node of ``gm`` keeps its experts module's entry alive in its meta (copied
    with the node into stage graphs), so a graph that runs or prices a dispatch finds its entry
    as long as the graph lives, whoever owns the module."""
    for node in gm.graph.nodes:
        i = _KEY_ARG.get(node.target) if node.op == "call_function" else None
        if i is not None and len(node.args) > i:
            node.meta["autopar_dispatch_entry"] = _entry(node.args[i])


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
    spec = _entry(node.args[4])
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
        return int(args[1].numel()) * _entry(args[3]).flops_per_row * 3 // 2
    elif target in FORWARD_OPS + BACKWARD_OPS:
        return 0
    else:
        return None
    return int(ids.numel()) * _entry(key).flops_per_row
