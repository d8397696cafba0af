"""Expert parallelism (EP): each of ``ep`` ranks holds ``E / ep`` experts of every MoE block.

``apply_expert_parallel(model, ep, ep_rank, group)`` rewrites every MoE block of ``model`` in
place and returns one ``ExpertShard`` per sharded parameter; ``moe_blocks(model)`` lists the
blocks it would shard (FQN, expert count) and ``refused_moe_blocks(model)`` the MoE-looking
blocks it refuses (FQN, why). Two kinds of block are recognized:

* ``autopar.nn.MoE`` with a static capacity (it drops overflow tokens, and so does its EP
  form, exactly as the single-process block): below; and in dropless mode
  (``capacity_factor=None``): the token-proportional dispatch op of passes/moe_dispatch.py,
  which moves exactly the routed rows;
* Hugging Face ``transformers`` blocks whose ``experts`` is a transformers experts module
  (``@use_experts_implementation``: Mixtral, Qwen2/Qwen3-MoE, DeepSeek-V3, ...): *dropless*,
  by the same op (see passes/hf_moe.py);
* blocks holding an experts module of any other form that keeps the same contract (every
  parameter ``[E, ...]``, called as ``experts(hidden [N, d], top_k_index [N, k], top_k_weights
  [N, k])``, static shapes) beside a router (a child with an ``[E, d]`` weight), whatever the
  two children are called: the same dispatch, running the module's own forward on each rank's
  experts (passes/hf_moe.py).

Any other block that looks like an MoE (an ``experts`` module that breaks that contract, or
experts held as separate modules) is refused by name, with what broke, before any
communication or change to the model.

The rewrite runs on the eager module, *before* ``capture``: the rewritten forward calls a
differentiable all-to-all, so the captured graph holds the forward all-to-alls and
``split_backward``'s joint trace gets their backward all-to-alls for free (design.md §9).
Parameter FQNs stay the model's own: a shard is the dim-0 slice of the full parameter.

Dispatch of a static-capacity ``autopar.nn.MoE`` (one rank, its own ``N`` tokens; ``E`` experts,
``El = E / ep`` per rank, capacity ``C`` from the local ``N`` exactly as ``MoE`` computes it):

1. route, rank and drop the local tokens exactly as ``MoE`` does, filling the expert buffer
   ``buf [E, C, d]`` (expert-major; an empty slot is an all-zero row with gate 0);
2. all-to-all #1: rows ``[j*El, (j+1)*El)`` of ``buf`` (the slots of rank j's experts) go to
   rank j; this rank receives ``[ep, El, C, d]`` (chunk i: rank i's tokens for our experts),
   viewed as ``[El, ep*C, d]``: every local expert sees ``ep * C`` slots;
3. the local experts (``GroupedExperts`` with ``w1, w3 [El, d, h]``, ``w2 [El, h, d]``) run on it;
4. all-to-all #2 (the inverse permutation): results go back to the rank that owns the tokens,
   which now holds ``[E, C, d]`` in expert order again;
5. combine (gate-weighted index-add into the tokens, shared experts) as ``MoE`` does.

So the output of each rank equals the single-process ``MoE`` (with all ``E`` experts) applied
to that rank's tokens; the load-balance loss is computed locally, as ``MoE`` does.

Why the all-to-all is *even*: every rank sends exactly ``El * C`` slots to every rank whatever
the routing, because the buffer has a static ``C`` slots per expert (empty slots are zero rows,
overflowing assignments are dropped before dispatch). The split sizes are therefore known at
trace time, no count exchange is needed, and the graph stays static. The price is that padded
slots travel and are computed. It requires every rank of the EP group to have the same local
token count ``N`` (same ``C``), which equal microbatch shapes guarantee.

Gradients, for both kinds (what the runtime must do): the backward of all-to-all #2 / #1 sends each expert's
output gradients to the rank holding the expert, so after backward an expert parameter on a
rank already holds the gradient from the tokens of *every* rank of its EP group. Hence:

* expert parameters (the ``ExpertShard`` FQNs): sum the gradient over the ranks that hold the
  *same* experts, i.e. the ranks with the same ``ep_rank`` among the ``dp * cp`` ranks of a
  pipeline stage (``dp * cp / ep`` of them; none when ``ep == dp * cp``);
* every other parameter (router, shared experts, the rest of the model): sum over all
  ``dp * cp`` ranks of the stage, as without EP.

With the loss tangent already scaled by ``1 / n_total`` (design.md §5) both are plain sums.
The forward all-to-alls run inside F, their backward counterparts inside I (on a stage whose
input carries a gradient, the MoE's input gradient needs both) or W (on a stage without such
an input, e.g. the first one), and B. So the ranks of an EP group must run the F, I, W and B
of the same (stage, microbatch) in the same order: the dp ranks of one pipeline rank share a
schedule, which gives exactly that; no rank may skip an action its peers run.
State dicts: gather each ``ExpertShard`` over the EP group along ``dim`` (rank order) to get
the full ``full_shape`` tensor; optimizers (and ZeRO) see the local shard only.
"""
from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

import torch
import torch.nn as nn

from autopar.collectives import comms
from autopar.nn import GroupedExperts, MoE

from . import grouped_experts, hf_moe, moe_dispatch

log = logging.getLogger("autopar")

__all__ = ["ExpertShard", "ExpertParallelMoE", "apply_expert_parallel", "check_expert_parallel", "moe_blocks",
           "expert_parameters", "refused_moe_blocks", "dispatch_form"]


@dataclass(frozen=True)
class ExpertShard:
    """Parameter ``fqn`` holds rows ``[ep_rank * n, (ep_rank + 1) * n)`` of dim ``dim`` of a
    ``full_shape`` tensor, ``n = full_shape[dim] // ep``; the ``ep`` ranks of its EP group hold
    the other rows, in rank order."""

    fqn: str
    dim: int
    full_shape: tuple[int, ...]
    ep: int
    ep_rank: int

    @property
    def local_shape(self) -> tuple[int, ...]:
        shape = list(self.full_shape)
        shape[self.dim] //= self.ep
        return tuple(shape)

    @property
    def rows(self) -> slice:
        """The slice of dim ``dim`` of the full tensor that this rank holds."""
        n = self.full_shape[self.dim] // self.ep
        return slice(self.ep_rank * n, (self.ep_rank + 1) * n)


class ExpertParallelMoE(MoE):
    """``MoE`` whose ``experts`` hold this rank's ``E / ep`` experts; ``compute_experts`` moves
    the expert buffer to the experts' ranks and back with two even all-to-alls.

    Made by ``apply_expert_parallel`` (which converts a ``MoE`` in place); not constructed
    directly. ``n_experts`` stays the global ``E``: routing is unchanged.
    """

    ep: int
    ep_rank: int
    ep_group: str | None  # group name (a string, so the module deep-copies); None when ep == 1

    @property
    def n_local_experts(self) -> int:
        return self.n_experts // self.ep

    def compute_experts(self, buf: torch.Tensor) -> torch.Tensor:
        if self.ep == 1:
            return self.experts(buf)
        n_experts, cap, d = buf.shape
        ep, n_local = self.ep, self.n_local_experts
        splits = [n_local * cap] * ep  # even: C static slots per expert, whatever the routing
        # buf is expert-major, so rows [j*El*C, (j+1)*El*C) are the slots of rank j's experts
        recv = comms.all_to_all_autograd(buf.reshape(n_experts * cap, d), splits, splits, self.ep_group)
        # [source rank, local expert, slot, d] -> [local expert, source rank * slot, d]
        x_local = recv.view(ep, n_local, cap, d).transpose(0, 1).reshape(n_local, ep * cap, d)
        y_local = self.experts(x_local)
        # back to [owner rank, local expert, slot, d]: chunk i returns to rank i, its tokens' rows
        send = y_local.view(n_local, ep, cap, d).transpose(0, 1).reshape(n_experts * cap, d)
        back = comms.all_to_all_autograd(send, splits, splits, self.ep_group)
        return back.view(n_experts, cap, d)  # chunk j came from rank j: expert order again

    def extra_repr(self) -> str:
        return (f"n_experts={self.n_experts}, top_k={self.top_k}, ep={self.ep}, ep_rank={self.ep_rank}, "
                f"local experts [{self.ep_rank * self.n_local_experts}, {(self.ep_rank + 1) * self.n_local_experts})")


def _ep_class(cls: type) -> type:
    """The expert-parallel class of ``cls`` (a subclass of MoE keeps its own overrides; made once,
    picklable by name: ``hf_moe.mixed_class``)."""
    return ExpertParallelMoE if cls is MoE else hf_moe.mixed_class(ExpertParallelMoE, cls)


_EXPECTED = f"autopar.nn.MoE (static capacity, batched experts [E, ...]) or {hf_moe.EXPECTED}"


def _scan(model: nn.Module):
    """(ours: [(fqn, MoE)], hf: [(block fqn, experts fqn, experts module)] (transformers experts
    modules and those of other forms), refused: [(fqn, class, why)]), in ``named_modules``
    order; a block FQN is "" for the root.

    A block is found by what it holds, whatever the names: a child that is a transformers
    experts module, or one of another form that keeps the experts contract (every parameter
    ``[E, ...]``, a forward of three positional tensors: ``_contract_child``) beside a router
    (a child with an ``[E, d]`` weight). A child called ``experts`` that breaks the contract is
    refused with what broke; under other names a module that does not keep it is not an MoE."""
    ours, hf, refused = [], [], []
    for name, m in model.named_modules():
        if isinstance(m, MoE):
            ours.append((name, m))
            continue
        attr = _experts_child(m)
        if attr is None:
            continue
        experts = getattr(m, attr)
        prefix = f"{name}.{attr}" if name else attr
        if hf_moe.is_hf_experts(experts):
            why = hf_moe.hf_refusal(experts)
            if why is None:
                hf.append((name, prefix, experts))
            else:
                refused.append((name, type(m).__name__, f"{prefix} ({type(experts).__name__}): {why}"))
            continue
        if isinstance(experts, (nn.ModuleList, nn.ModuleDict)):
            refused.append((name, type(m).__name__, f"{prefix} is a {type(experts).__name__} (separate expert "
                                                    "modules, routed with data-dependent shapes)"))
        elif attr != "experts" or any(isinstance(getattr(m, r, None), nn.Module) for r in ("gate", "router")):
            why = _form_refusal(experts, m)  # an experts module of another form
            if why is None:
                hf.append((name, prefix, experts))
            else:
                refused.append((name, type(m).__name__, f"{prefix} ({type(experts).__name__}): {why}"))
    return ours, hf, refused


def _experts_child(block: nn.Module) -> str | None:
    """The attribute of ``block``'s experts module (see ``_scan``), or None."""
    children = [(a, c) for a, c in block.named_children() if not isinstance(c, GroupedExperts)]
    for attr, child in children:
        if hf_moe.is_hf_experts(child):
            return attr
    named = getattr(block, "experts", None)
    if isinstance(named, nn.Module) and not isinstance(named, GroupedExperts):
        return "experts"
    for attr, child in children:
        if _contract_child(block, child):
            return attr
    return None


def _contract_child(block: nn.Module, child: nn.Module) -> bool:
    """Whether ``child`` looks like an experts module of another form: not a list of modules,
    every parameter ``[E, ...]`` with ``E >= 2``, a forward of three positional tensors, and a
    sibling router with an ``[E, d]`` weight (``hf_moe.router_of``)."""
    if isinstance(child, (nn.ModuleList, nn.ModuleDict)) or hf_moe.parameter_refusal(child) is not None:
        return False
    n = hf_moe.expert_count(child)
    return bool(n and n >= 2 and hf_moe.signature_refusal(child) is None
                and hf_moe.router_of(block, child, n) is not None)


def _form_refusal(experts: nn.Module, block: nn.Module, ep: int = 1) -> str | None:
    """Why EP cannot shard an experts module that is not a transformers one, at ``ep``: called
    with rows grouped by expert (one positional tensor, passes/grouped_experts.py) or with the
    three tensors of the dropless contract (passes/hf_moe.py)."""
    if grouped_experts.is_grouped(experts):
        return grouped_experts.grouped_refusal(experts, block, ep)
    return hf_moe.generic_refusal(experts, block, ep)


_EP_FORMS = (hf_moe.HFExpertParallel, hf_moe.GenericExpertParallel, grouped_experts.GroupedExpertParallel)


def moe_blocks(model: nn.Module) -> list[tuple[str, int]]:
    """``[(fqn, n_experts)]`` of every MoE block ``apply_expert_parallel`` shards, in module
    order: each ``autopar.nn.MoE`` (its FQN) and each recognized Hugging Face block (the FQN of
    the module holding ``experts``, e.g. ``model.layers.1.mlp``); ``""`` is the root. The count
    is the global one, also after the rewrite. ``ep`` must divide every count; a model for which
    ``refused_moe_blocks`` is not empty is refused whatever ``ep`` (ep=1 included)."""
    ours, hf, _refused = _scan(model)
    found = [(name, m.n_experts) for name, m in ours] + [(name, hf_moe.expert_count(e)) for name, _p, e in hf]
    order = {name: i for i, (name, _m) in enumerate(model.named_modules())}
    return sorted(found, key=lambda item: order[item[0]])


def expert_parameters(model: nn.Module) -> list[str]:
    """FQNs of the parameters ``apply_expert_parallel`` shards (dim 0, ``E / ep`` experts per
    rank), in module order; shared experts and routers are not among them (DeepSeek-V3's
    ``mlp.shared_experts.*`` contains "experts." but stays replicated)."""
    ours, hf, _refused = _scan(model)
    fqns = [f"{name}.experts.{p}" if name else f"experts.{p}" for name, m in ours
            for p, t in m.experts.named_parameters(recurse=False) if t is not None]
    fqns += [f"{prefix}.{p}" for _name, prefix, e in hf
             for p, _t in e.named_parameters(recurse=not hf_moe.is_hf_experts(e))]
    order = {f: i for i, (f, _p) in enumerate(model.named_parameters())}
    return sorted(fqns, key=order.__getitem__)


def refused_moe_blocks(model: nn.Module) -> list[tuple[str, str]]:
    """``[(fqn, why)]`` of every block that looks like an MoE but that EP cannot shard."""
    return [(name or "<root>", f"{cls}: {why}") for name, cls, why in _scan(model)[2]]


def _resolve_group(group, ep: int, ep_rank: int) -> str | None:
    if ep == 1:
        return None
    if not comms.initialized():
        raise ValueError(f"autopar: expert parallelism with ep={ep} needs an initialized process group "
                         "(torch.distributed.init_process_group) and the EP group passed as `group`; "
                         "use ep=1 without one")
    name = comms.group_name(group)
    size = comms.size_of(name)
    if size != ep:
        raise ValueError(f"autopar: the EP group has {size} ranks but ep={ep}; pass the process group of "
                         f"the {ep} ranks that share the experts (e.g. dist.new_group(ranks) or a DeviceMesh axis)")
    rank = comms.rank_in(name)
    if rank != ep_rank:
        raise ValueError(f"autopar: ep_rank={ep_rank} but this process is rank {rank} of the EP group; "
                         f"pass ep_rank=dist.get_rank(group)")
    return name


def _fold_group(model: nn.Module, ours, hf, group, fold: int) -> str | None:
    """The name of the group of ``fold`` tensor-parallel ranks the experts are folded over (each
    routes its share of the rows: ``moe_dispatch.dropless_experts``), or None for ``fold == 1``.
    Only dropless dispatches fold: a static-capacity block computes its capacity from the rows it
    routes, so routing a share of them would drop other tokens than one process does."""
    if fold == 1:
        return None
    static = [name or "<root>" for name, m in ours if not m.dropless]
    static += [name or "<root>" for name, _p, e in hf if grouped_experts.is_grouped(e)]
    if static:
        raise ValueError(f"autopar: experts folded over tp={fold} ranks (tp > 1 and ep > 1) route each tp rank's share "
                         f"of the tokens, but {', '.join(static)} has a static capacity computed from the tokens it "
                         "routes, so it would drop other tokens than the model does; use a dropless block "
                         "(autopar.nn.MoE(capacity_factor=None)), or tp=1 with ep, or ep=1 with tp")
    if not comms.initialized():
        raise ValueError(f"autopar: experts folded over tp={fold} ranks need the tensor-parallel process group")
    name = comms.group_name(group)
    if comms.size_of(name) != fold:
        raise ValueError(f"autopar: the fold group has {comms.size_of(name)} ranks but tp={fold}")
    return name


def check_expert_parallel(model: nn.Module, ep: int, ep_rank: int = 0):
    """Every check ``apply_expert_parallel`` makes before it touches a process group or the
    model (ValueError naming the block and the fix); returns (autopar MoEs, Hugging Face
    blocks) as ``_scan`` does. Pure: call it before building the mesh to fail before any
    communication."""
    if not isinstance(ep, int) or ep < 1:
        raise ValueError(f"autopar: ep must be a positive integer, got {ep!r}")
    if not isinstance(ep_rank, int) or not 0 <= ep_rank < ep:
        raise ValueError(f"autopar: ep_rank must be in [0, ep={ep}), got {ep_rank!r}")
    ours, hf, refused = _scan(model)
    if refused:
        names = [name or "<root>" for name, _c, _w in refused]
        kinds = sorted({cls for _n, cls, _w in refused})
        lines = "; ".join(f"{name or '<root>'} ({cls}): {why}" for name, cls, why in refused[:4])
        raise ValueError(f"autopar: expert parallelism does not support the MoE block(s) {names[:4]} "
                         f"({', '.join(kinds)}): {lines}. Expected {_EXPECTED}; or use ep=1")
    if not ours and not hf:
        raise ValueError(f"autopar: ep={ep} but {type(model).__name__} has no MoE block expert parallelism can "
                         f"shard (expected {_EXPECTED}); build the model's MoE layers with autopar.nn.MoE, or use ep=1")
    done = ([name or "<root>" for name, m in ours if isinstance(m, ExpertParallelMoE)]
            + [name or "<root>" for name, _p, e in hf
               if isinstance(e, _EP_FORMS)])
    if done:
        raise ValueError(f"autopar: {done[:4]} are already expert-parallel; apply_expert_parallel runs once per model")
    for name, n_experts in [(n, m.n_experts) for n, m in ours] + [(n, hf_moe.expert_count(e)) for n, _p, e in hf]:
        if n_experts % ep:
            raise ValueError(f"autopar: MoE block {name or '<root>'} has n_experts={n_experts}, not divisible by "
                             f"ep={ep}; pick ep among the divisors of {n_experts} "
                             f"({[k for k in range(1, n_experts + 1) if n_experts % k == 0]})")
    for name, prefix, e in hf:
        why = None if ep == 1 or hf_moe.is_hf_experts(e) else _form_refusal(e, model.get_submodule(name), ep)
        if why:  # its own code on the E / ep local experts (the E ones passed in _scan)
            raise ValueError(f"autopar: expert parallelism does not support MoE block {name or '<root>'} at ep={ep}: "
                             f"{prefix} ({type(e).__name__}) with its {hf_moe.expert_count(e) // ep} local experts: "
                             f"{why}. Expected {_EXPECTED}; or use ep=1")
    for name, m in ours:
        if not isinstance(m.experts, GroupedExperts):
            raise ValueError(f"autopar: MoE {name or '<root>'}.experts is a {type(m.experts).__name__}, "
                             "expected GroupedExperts (batched expert weights [E, ...])")
    return ours, hf


def apply_expert_parallel(model: nn.Module, ep: int, ep_rank: int, group=None, fold_group=None,
                          fold: int = 1) -> dict[str, ExpertShard]:
    """Shard the experts of every MoE block of ``model`` (``moe_blocks``) over ``ep`` ranks, in place.

    This rank keeps experts ``[ep_rank * E/ep, (ep_rank + 1) * E/ep)`` of each block as copies
    under the same FQNs (``...experts.w1`` now ``[E/ep, d, h]``, Hugging Face
    ``...mlp.experts.gate_up_proj`` now ``[E/ep, 2h, d]``); routers, shared experts and
    buffers stay replicated. A block that looks like an MoE but is not recognized
    (``refused_moe_blocks``) makes it raise, naming the block, before anything changes.
    ``group`` is the EP process group (a ProcessGroup, group name or 1-D DeviceMesh; None: the
    default group) of ``ep`` ranks; this process must be its rank ``ep_rank``.
    ``ep == 1`` needs no process group and leaves the numbers unchanged.

    Returns ``{fqn: ExpertShard}`` for every sharded parameter. Build the optimizer after this
    call: parameters created before it still reference the full expert tensors.
    """
    ours, hf = check_expert_parallel(model, ep, ep_rank)
    fold_name = _fold_group(model, ours, hf, fold_group, fold)
    group_name = _resolve_group(group, ep, ep_rank)  # fails here, before any module changes

    shards: dict[str, ExpertShard] = {}
    for name, prefix, experts in hf:
        apply = hf_moe.apply_hf_expert_parallel if hf_moe.is_hf_experts(experts) else \
            grouped_experts.apply_grouped_expert_parallel if grouped_experts.is_grouped(experts) else \
            hf_moe.apply_generic_expert_parallel
        for fqn, full_shape in apply(experts, prefix + ".", ep, ep_rank, group_name, model.get_submodule(name)):
            shards[fqn] = ExpertShard(fqn, 0, full_shape, ep, ep_rank)
        if fold > 1:
            experts.ep_fold, experts.ep_fold_group = fold, fold_name
        n_local = hf_moe.expert_count(experts) // ep
        form = "rows grouped by expert" if isinstance(experts, grouped_experts.GroupedExpertParallel) else "dropless"
        log.info("expert_parallel: %s (%s, %s) keeps experts [%d, %d) of %d (ep=%d, rank %d)",
                 name or "<root>", type(experts).__name__, form, ep_rank * n_local, (ep_rank + 1) * n_local,
                 hf_moe.expert_count(experts), ep, ep_rank)
    for name, m in ours:
        n_local = m.n_experts // ep
        lo, hi = ep_rank * n_local, (ep_rank + 1) * n_local
        experts = m.experts
        prefix = f"{name}.experts." if name else "experts."
        for pname, p in list(experts._parameters.items()):
            if p is None:
                continue
            assert p.shape[0] == m.n_experts, (prefix + pname, tuple(p.shape))
            # a copy of the slice: the full tensor is no longer referenced by the model
            local = nn.Parameter(p.detach()[lo:hi].clone(), requires_grad=p.requires_grad)
            experts._parameters[pname] = local  # same position: named_parameters() keeps its order
            shards[prefix + pname] = ExpertShard(prefix + pname, 0, tuple(p.shape), ep, ep_rank)
        m.__class__ = _ep_class(type(m))
        m.ep, m.ep_rank, m.ep_group = ep, ep_rank, group_name
        if fold > 1:
            m.ep_fold, m.ep_fold_group = fold, fold_name
        if m.dropless:
            moe_dispatch.set_layer_name(m.experts, name or "<root>")
        log.info("expert_parallel: %s keeps experts [%d, %d) of %d (ep=%d, rank %d)",
                 name or "<root>", lo, hi, m.n_experts, ep, ep_rank)
    return shards


_EP_ATTRS = ("ep", "ep_rank", "ep_group", "ep_experts", "ep_local", "_autopar_dispatch_key", "_autopar_dispatch")


@contextlib.contextmanager
def dispatch_form(model: nn.Module):
    """While active, every experts module of ``model`` that expert parallelism shards dropless
    (a Hugging Face experts module, or one of another form keeping the same contract:
    passes/hf_moe.py) runs as its expert-parallel form at ep = 1: one ``autopar::moe_dispatch``
    op over all its experts, with no group (no communication), the module's own code on the
    routed rows. So a user's MoE model is captured with the dispatch op the runtime runs under
    EP, and the planner prices it from that op (planner/routed.py ``routed_of``) exactly as
    the presets and ``autopar.nn.MoE(capacity_factor=None)``. The module's class and attributes
    are restored on exit (its dispatch registration stays, owned by the module as
    ``_autopar_dispatch_form``: the captured graph reads the key). At ep = 1 the runtime
    runs the module's own implementation instead (grouped_mm: the same rows and FLOPs; W's
    re-walk of the op is priced on top, planner/time_model.py)."""
    _ours, found, _refused = _scan(model)
    undo = []
    try:
        for name, _prefix, experts in found:
            if isinstance(experts, _EP_FORMS) or grouped_experts.is_grouped(experts):
                continue  # already rewritten (EP > 1: it holds the dispatch op), or the static grouped form
            n = hf_moe.expert_count(experts)
            before = (experts.__class__, {a: experts.__dict__[a] for a in _EP_ATTRS if a in experts.__dict__})
            undo.append((experts, before))
            if hf_moe.is_hf_experts(experts):
                experts.__class__ = hf_moe._ep_class(type(experts))
            else:
                experts.__class__ = hf_moe._generic_class(type(experts))
                experts.ep_local = n
            experts.ep, experts.ep_rank, experts.ep_group, experts.ep_experts = 1, 0, None, n
            hf_moe._register(experts, model.get_submodule(name), name or "<root>", n, n)
        yield
    finally:
        for experts, (cls, attrs) in reversed(undo):
            # the captured graph's key must keep finding its entry after the capture (the planner
            # traces and times its units later): the module keeps it, where
            # collectives/moe_exchange.entries_of finds it for serving
            experts.__dict__["_autopar_dispatch_form"] = experts.__dict__.get("_autopar_dispatch")
            experts.__class__ = cls
            for a in _EP_ATTRS:
                experts.__dict__.pop(a, None)
            experts.__dict__.update(attrs)
