"""The dropless MoE dispatch at run time: the entries of the experts modules, the count exchange,
the uneven all-to-alls and their buffers, the local experts' private autograd graph, receive
statistics and bounds. The graph ops that call these (and their autograd formula, fake kernels
and what the planner reads of them) are defined in passes/moe_dispatch.py, whose docstring
describes the dispatch; this is the runtime's side of it, beside its other communication code.

State is owned, never global. Each experts module owns its ``ExpertsEntry``
(``module._autopar_dispatch``: runner, receive policy, statistics, dispatches in flight), so it
lives and dies with its model. A graph op carries its module's integer key; it finds the entry
among the entries *served* where it runs (``serving``: a context variable, set for the length of
one call and reset after): the model's ``ParallelModel`` serves its own entries around each step
(``Built.moe_entries``), an experts module serves its own around its eager forward, and an eager
backward serves what its forward was served. Two models in one process, a model and its
evaluation copy, never see each other's entries, states or statistics, and a key no running model
serves is an error naming it. A handle (what travels from F to I and W inside the graph) carries
its entry's key in its high bits and the entry's own dispatch number in its low bits.
"""
from __future__ import annotations

import contextlib
import contextvars
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Callable

import torch

log = logging.getLogger("autopar")

KEY_SHIFT = 32  # a handle is (entry key << KEY_SHIFT) | the entry's dispatch number


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
class ExpertsEntry:
    """One registered experts module's dispatch entry, owned by the module
    (``module._autopar_dispatch``): how to run its local experts on received rows, its receive
    policy and statistics, and its dispatches in flight."""

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
    key: int = 0  # what the graph ops carry to find this entry among the served ones (``serving``)
    dispatches: int = 0  # dispatches started (the low bits of their handles)

    def __deepcopy__(self, memo):
        return self  # copies of an experts module share its entry (the graph passes the values)




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




# the entries the graph ops may use where they run (``serving``): per context, never a registry
_SERVED: contextvars.ContextVar = contextvars.ContextVar("autopar_moe_served", default=MappingProxyType({}))
# a fused backward (B, or eager autograd) runs: the input-gradient op computes the weight gradients too
_FUSED: contextvars.ContextVar = contextvars.ContextVar("autopar_moe_fused", default=False)


def entries_of(model: torch.nn.Module) -> dict[int, ExpertsEntry]:
    """``{key: entry}`` of every registered experts module of ``model`` (also those a capture
    registered for the planner, ``expert_parallel.dispatch_form``)."""
    out = {}
    for m in model.modules():
        for attr in ("_autopar_dispatch", "_autopar_dispatch_form"):
            e = m.__dict__.get(attr)
            if isinstance(e, ExpertsEntry):
                out[e.key] = e
    return out


@contextlib.contextmanager
def serving(entries):
    """While inside, the graph ops find the experts modules of ``entries`` (``{key: entry}`` or
    an iterable of entries) by their keys, besides those already served."""
    table = entries if isinstance(entries, Mapping) else {e.key: e for e in entries}
    if not table:
        yield
        return
    served = _SERVED.get()
    for k, e in table.items():
        if served.get(k, e) is not e:
            raise RuntimeError(f"autopar: two MoE experts modules share the dispatch key {k} "
                               f"({served[k].layer} and {e.layer}); register each module once")
    token = _SERVED.set(MappingProxyType({**served, **table}))
    try:
        yield
    finally:
        _SERVED.reset(token)


def served() -> Mapping[int, ExpertsEntry]:
    """The entries served here (``serving``), read-only."""
    return _SERVED.get()


def entry(key: int) -> ExpertsEntry:
    spec = _SERVED.get().get(key)
    if spec is None:
        raise RuntimeError(f"autopar: MoE dispatch key {key}: no running model serves its experts module here. The "
                           "dispatch ops run inside their model's ParallelModel step, the experts module's own "
                           "forward, or collectives.moe_exchange.serving(entries_of(model)) for a graph run by hand")
    return spec


def release(handle) -> None:
    """Drop a dispatch's state (nothing will read it: an eager forward without backward)."""
    _state(handle, pop=True).release()


def _state(handle, pop: bool = False) -> _State:
    h = int(handle)
    states = entry(h >> KEY_SHIFT).states
    return states.pop(h) if pop else states[h]


@contextlib.contextmanager
def fused_backward():
    """While a fused backward (B: I and W of one microbatch back to back) runs: the
    input-gradient op walks the experts' private graph once for the rows', routing weights'
    and parameters' gradients together, and the weight-gradient op returns the latter; under a
    split backward (W deferred) they are the two walks of passes/moe_dispatch.py's docstring."""
    token = _FUSED.set(True)
    try:
        yield
    finally:
        _FUSED.reset(token)


def receive_stats(entries) -> dict:
    """Over the experts modules' ``entries`` (a model's: ``Built.moe_entries``): the largest receive
    (rows) of one rank in one dispatch since ``reset_stats``, the mean receive per dispatch, their
    ratio, the layer of the largest, the dispatches, and how many of them went over their priced
    ratio."""
    specs = list(entries)
    calls = sum(sp.stats.calls for sp in specs)
    mean = sum(sp.stats.rows for sp in specs) / calls if calls else 0.0
    worst = max(specs, key=lambda sp: sp.stats.max_rows, default=None)
    top = worst.stats.max_rows if worst is not None else 0
    return {"max_rows": top, "mean_rows": mean, "ratio": top / mean if mean else 0.0,
            "layer": worst.layer if worst is not None and top else "", "dispatches": calls,
            "over_priced": sum(sp.stats.over for sp in specs)}


def reset_stats(entries) -> None:
    for sp in entries:
        sp.stats = _Receives()


def clear(entries) -> None:
    """Drop the live dispatch states (what a failed or forward-only step left behind) of the
    experts modules' ``entries``."""
    for spec in entries:
        for st in spec.states.values():
            st.release()
        spec.states.clear()


@contextlib.contextmanager
def model_step(entries, backward: bool = True):
    """One step of a model whose dropless experts modules have ``entries``: what a failed step
    left behind is dropped and the receive statistics restart, the entries are served while the
    step runs, and after a forward-only step (``backward=False``: nothing reads the routed rows)
    its dispatch states are dropped."""
    entries = tuple(entries)
    clear(entries)
    reset_stats(entries)
    with serving(entries):
        yield
    if not backward:
        clear(entries)


def live_handles(entries) -> int:
    """Dispatch states in flight of the experts modules' ``entries``."""
    return sum(len(spec.states) for spec in entries)


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


def exchange_counts(counts: torch.Tensor, group, ep: int) -> torch.Tensor:
    """``[ep, E]``: row ``i`` the per-expert assignment counts of group rank ``i``."""
    if ep == 1:
        return counts.unsqueeze(0)
    import torch.distributed as dist

    out = counts.new_empty(ep * counts.numel())
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # (the name before torch 2.13)
    gather(out, counts, group=group)
    return out.view(ep, counts.numel())


def check_bound(spec: ExpertsEntry, table: torch.Tensor, ep: int, n_local: int, row_bytes: int = 0) -> list[int]:
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


def send_rows(x, ids, weights, key, group, ep, n_local):
    """Dispatch, started: counts exchanged (and the bound checked), the rows and their routing
    weights on their way (async); a new handle."""
    spec = entry(key)
    k = ids.shape[1]
    pg = _group(group) if ep > 1 else None
    me = pg.rank() if pg is not None else 0
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # by expert: by destination rank, then local expert
    counts = torch.bincount(flat, minlength=ep * n_local)
    table = exchange_counts(counts, pg, ep)  # [source rank, expert]
    check_bound(spec, table, ep, n_local, row_bytes=spec.saved_row_elems * x.element_size())
    per_dest = table.view(ep, ep, n_local)
    mine = per_dest[:, me]  # [source rank, local expert]: the rows this rank receives
    # local expert of every received row: source-major, then expert-major within a source
    local_ids = torch.repeat_interleave(torch.arange(n_local, device=x.device).repeat(ep), mine.reshape(-1))
    st = _State(spec.layer, order, per_dest[me].sum(dim=1).tolist(), mine.sum(dim=1).tolist(), local_ids,
                mine.sum(dim=0).tolist())
    _all_to_all(st, "rows", x.index_select(0, torch.div(order, k, rounding_mode="floor")), st.recv, st.send, pg)
    _all_to_all(st, "weights", weights.reshape(-1).index_select(0, order), st.recv, st.send, pg)
    spec.dispatches += 1
    handle = (key << KEY_SHIFT) | spec.dispatches
    spec.states[handle] = st
    return torch.tensor(handle, dtype=torch.int64)


def run_experts(handle, params, key, group, ep, recompute):
    """The received rows through the local experts (private autograd graph; with ``recompute``
    none: only the rows and their weights are kept, and I runs the experts again); the
    combine started."""
    spec, st = entry(key), _state(handle)
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


def combine_rows(x, ids, handle):
    """Every row back at its token's rank: each token's k rows summed in choice order."""
    st = _state(handle)
    back = st.wait()["back"]
    n, k = ids.shape
    per_assignment = torch.empty_like(back).index_copy_(0, st.order, back)
    return per_assignment.view(n, k, x.shape[1]).sum(dim=1).to(x.dtype), torch.tensor(int(handle), dtype=torch.int64)


def send_grads(grad_y, handle, ids, group, ep):
    """I, started: each assignment's output gradient (its token's) on its way to the expert's rank."""
    st = _state(handle)
    k = ids.shape[1]
    g_send = grad_y.index_select(0, torch.div(st.order, k, rounding_mode="floor")).to(st.rows.dtype)
    _all_to_all(st, "grad_rows", g_send, st.recv, st.send, _group(group) if ep > 1 else None)
    return torch.tensor(int(handle), dtype=torch.int64)


def input_grads(handle, params, key, group, ep, last):
    """The received rows' and routing weights' gradients (and, in a fused backward, the
    parameters'); their return started. A recomputing dispatch first runs its experts again."""
    st = _state(handle)
    if st.recompute:
        _private_graph(entry(key), st, params, st.rows, st.weights)
    g_rows = st.wait()["grad_rows"]
    fuse = _FUSED.get() and not last and bool(st.params)
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


def combine_grads(handle, grad_y, ids, weights, last):
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


def weight_grads(handle, params):
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
