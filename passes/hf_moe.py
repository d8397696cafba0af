"""Expert parallelism for Hugging Face ``transformers`` MoE blocks: dropless, static shapes.

Which blocks (``is_hf_experts`` / ``hf_refusal``): a block whose ``experts`` child is a
transformers experts module, i.e. a class decorated with ``@use_experts_implementation``
(Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3 and most MoE families of transformers 5): its
expert weights are 3-D parameters with the expert on dim 0 (``gate_up_proj [E, 2h, d]``,
``down_proj [E, d, h]``, optional ``*_bias [E, ...]``) and it is called as
``experts(hidden_states [N, d], top_k_index [N, k], top_k_weights [N, k]) -> [N, d]``,
``sum_j top_k_weights[n, j] * expert_{top_k_index[n, j]}(hidden_states[n])`` (the three inputs
are taken by position, whatever their names: GPT-OSS calls them ``router_indices,
routing_weights``; ``_call_args`` checks their shapes and dtypes). Everything else
of the block (router, group-limited sigmoid routing and its selection bias, shared experts and
their gate, jitter) is left alone and runs replicated on every rank, so only that one call is
made distributed. The experts' ``experts_implementation`` must be ``grouped_mm`` (the
default) or ``batched_mm``: those are the static-shape implementations (``eager`` loops over
``nonzero()``, which no static graph can hold).

Experts modules of any other form (``generic_refusal`` / ``run_local_experts``): a block
with a ``gate`` / ``router`` child whose ``experts`` child is any other module (a user's own
class, or a transformers experts class with its forward overridden) is sharded too when it keeps
the same contract: every parameter of it (its children's included; any names, any number, e.g.
per-expert biases or output scales ``[E, d]``) holds the ``E`` experts on dim 0, its forward
takes exactly ``(hidden_states [N, d], top_k_index [N, k], top_k_weights [N, k]) -> [N, d]``,
its output is the sum over the ``k`` choices of a term of (token, expert, weight) and every
shape in it is static. ``E`` is its ``num_experts``-like attribute (``_COUNT_ATTRS``) or else
the leading dim of its first parameter. The receiving rank runs the module's own forward
(``run_local_experts``) on the rows it received as ``k = 1`` with its parameters sliced to the
local experts and its ``num_experts``-like attributes set to ``El``; the owner sums its ``k``
results per token. The contract is checked before any process group work by running the forward on fake
tensors (``FakeTensorMode``, no data, no shape environment): with all ``E`` experts when the
block is scanned, and with ``E / ep`` when ``ep`` is known; ``nonzero()``, boolean masks,
``unique()``, ``.item()`` or Python control flow on tensor values raise there, and the block is
refused with the reason (as is a parameter without leading dim ``E``, a per-expert buffer, or
another call signature).

Why tiny Mixtral / Qwen3-MoE capture without EP: transformers 5 picks
``experts_implementation="grouped_mm"`` when none is requested
(``PreTrainedModel.get_correct_experts_implementation``). Its forward sorts the ``N * k``
(token, expert) pairs by expert, counts them with ``histc``, and runs
``grouped_mm(x_sorted, W, offs=cumsum(counts))``; under ``torch.export`` (which sets
``torch.compiler.is_compiling()``) a non-bf16 weight takes the custom op
``transformers::grouped_mm_fallback``, which has a fake kernel and a registered autograd
formula. Every shape is ``[N * k, ...]`` whatever the routing: one static graph. Their
``_is_expert_parallel`` flag makes the same implementations accept a sentinel expert id
``>= num_experts`` (a padding row: sorted to the tail, outside every group, its output
zeroed), which is what this rewrite builds on.

Dispatch (both kinds): the expert-parallel module's forward is one ``autopar::moe_dispatch``
graph op (passes/moe_dispatch.py): per-expert counts exchanged, the routed rows and their
routing weights moved by uneven all-to-alls, the module's own forward (its
``experts_implementation`` for a transformers module) on exactly the rows each rank received
(``num_experts = El``, ``k = 1`` per row, the routing weight applied inside as the module
does), the reverse all-to-all, and each token's ``k`` results summed in choice order, as the
implementations do. So the result equals the unsharded module's up to the order of fp32 row
products inside a matmul, no token is dropped whatever the routing, and per MoE block and
microbatch a rank moves and keeps ``N * k`` routed rows on average (the count exchange adds
``ep * E`` integers), not a worst-case buffer.

Gradients: the op's backward is two ops, the input gradient (reverse all-to-alls) in I and the
expert weights' gradient in W without communication, so an expert parameter's gradient on a
rank already sums the tokens of every rank of its EP group; the data-parallel owner then sums
it over the replicas holding the same experts, like ``autopar.nn.MoE``'s (see
passes/expert_parallel.py).
"""
from __future__ import annotations

import inspect
import logging
import weakref
from typing import Callable

import torch
import torch.nn as nn

from . import moe_dispatch

log = logging.getLogger("autopar")

__all__ = ["STATIC_IMPLEMENTATIONS", "is_hf_experts", "hf_refusal", "hf_expert_count", "apply_hf_expert_parallel",
           "generic_refusal", "expert_count", "run_local_experts", "apply_generic_expert_parallel",
           "parameter_refusal", "fake_local_call", "keep_local_experts", "mixed_class"]

STATIC_IMPLEMENTATIONS = ("grouped_mm", "batched_mm")
EXPECTED = ("a Hugging Face experts module made by transformers' @use_experts_implementation (3-D expert "
            "parameters with the expert on dim 0, e.g. gate_up_proj [E, 2h, d] and down_proj [E, d, h], called as "
            "experts(rows, expert ids, routing weights), any names) with experts_implementation "
            f"{' or '.join(map(repr, STATIC_IMPLEMENTATIONS))}, or an experts module of another form: every "
            "parameter with the E experts on dim 0, called as experts(rows [N, d], expert ids [N, k], "
            "routing weights [N, k]) -> [N, d] (three positional tensors, any names), with static shapes (no "
            "nonzero(), boolean masks, .item())")
# attributes holding the expert count that a module's own code may read (set to E / ep on a rank)
_COUNT_ATTRS = ("num_experts", "n_experts", "num_local_experts", "n_routed_experts")


def _first_forward(cls: type):
    """The ``forward`` that ``cls`` runs: the first in its MRO, the EP mixins of this file skipped."""
    for c in cls.__mro__:
        if getattr(c, "_autopar_ep_mixin", False):  # HFExpertParallel and the LocalExperts mixins (inherited)
            continue
        if "forward" in c.__dict__:
            return c.__dict__["forward"]
    return None


def _hf_forward(cls: type):
    """The original forward under transformers' dispatching wrapper (``@use_experts_implementation``)
    of the first class in ``cls``'s MRO that has one, or None."""
    for c in cls.__mro__:
        fwd = c.__dict__.get("forward")
        code = getattr(fwd, "__code__", None)
        if code is not None and "experts_interface" in code.co_freevars and hasattr(fwd, "__wrapped__"):
            return fwd.__wrapped__
    return None


def is_hf_experts(module: nn.Module) -> bool:
    """A transformers experts module (``@use_experts_implementation``), recognized or not; a
    subclass with its own ``forward`` is not one (its code is not the implementations'): it is
    an experts module of another form (``generic_refusal``)."""
    fwd = _first_forward(type(module))
    code = getattr(fwd, "__code__", None)
    return (hasattr(module, "_is_expert_parallel") and hasattr(module, "has_gate")
            and hasattr(module, "config") and code is not None and "experts_interface" in code.co_freevars
            and hasattr(fwd, "__wrapped__"))


def hf_expert_count(module: nn.Module) -> int:
    """Global expert count of a transformers experts module (also after the EP rewrite)."""
    return int(getattr(module, "ep_experts", module.num_experts))


def hf_refusal(module: nn.Module) -> str | None:
    """Why EP cannot shard this transformers experts module, or None when it can."""
    why = signature_refusal(module)
    if why:
        return why
    n_experts = getattr(module, "num_experts", None)
    if not isinstance(n_experts, int) or n_experts < 1:
        return f"it has no integer num_experts (got {n_experts!r})"
    own = [(name, p) for name, p in module.named_parameters(recurse=False)]
    if not own:
        return "it has no expert parameters of its own"
    for name, p in own:
        if p.dim() < 2 or p.shape[0] != n_experts:
            return f"parameter {name} has shape {tuple(p.shape)}, expected the {n_experts} experts on dim 0"
    impl = getattr(module.config, "_experts_implementation", None)
    if impl not in STATIC_IMPLEMENTATIONS:
        return (f"its experts_implementation is {impl!r}, which is not a static-shape implementation; call "
                f"model.set_experts_implementation('grouped_mm') (or pass experts_implementation='grouped_mm' "
                "to from_pretrained / from_config)")
    return None


def _call_args(module, args, kwargs) -> tuple:
    """The experts' three inputs, in the order of its forward's parameters, whatever their
    names (transformers' Mixtral: ``top_k_index, top_k_weights``; GPT-OSS: ``router_indices,
    routing_weights``; a user's own) and however the block passes them (by position or
    keyword), checked against the contract: rows ``[N, d]`` floating, expert ids ``[N, k]``
    integer, routing weights ``[N, k]`` floating."""
    bound = _signature(module).bind(module, *args, **kwargs)
    bound.apply_defaults()
    hidden, index, weights = list(bound.arguments.values())[1:4]
    ok = all(isinstance(t, torch.Tensor) for t in (hidden, index, weights))
    if not ok or hidden.dim() != 2 or index.dim() != 2 or index.shape != weights.shape \
            or index.shape[0] != hidden.shape[0] or not hidden.is_floating_point() \
            or index.is_floating_point() or index.is_complex() or not weights.is_floating_point():
        shown = ", ".join(f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
                          for t in (hidden, index, weights))
        raise ValueError(f"autopar: expert-parallel {type(module).__name__} expects (rows [N, d] floating, expert ids "
                         f"[N, k] integer, routing weights [N, k] floating) as its three inputs; got {shown}")
    return hidden, index, weights

def _dispatch(module, hidden_states, top_k_index, top_k_weights, n_local: int) -> torch.Tensor:
    """The token-proportional dropless dispatch (passes/moe_dispatch.py) of an expert-parallel
    experts module: its rows go to the ranks of their experts, whose own code runs on them."""
    params = dict(module.named_parameters())
    spec_names = moe_dispatch.registered_names(module)
    return moe_dispatch.dropless_experts(hidden_states, top_k_index, top_k_weights, [params[n] for n in spec_names],
                                         module, module.ep_group, module.ep, n_local,
                                         getattr(module, "ep_fold_group", None), getattr(module, "ep_fold", 1))


def _block_name(prefix: str) -> str:
    """The block FQN of an experts prefix ``"<block>.<attr>."`` ("<root>" for a root block)."""
    head = prefix.rstrip(".")
    return head.rsplit(".", 1)[0] if "." in head else "<root>"


def _register(experts: nn.Module, block: nn.Module | None, layer: str, n_experts: int, n_local: int) -> None:
    """Register the module's own forward as its local runner (``k = 1`` per received row)."""
    params = dict(experts.named_parameters())
    run = moe_dispatch.module_runner(experts, run_local_experts)
    config = getattr(experts, "config", None)
    d = getattr(config, "hidden_size", None) or _hidden_size_candidates(experts, block, n_experts)[0]
    moe_dispatch.register_experts(experts, run, params, layer, n_experts, d)


class HFExpertParallel:
    """Mixin over a transformers experts class: this rank holds experts
    ``[ep_rank * El, (ep_rank + 1) * El)``; ``forward`` takes global expert ids and moves the
    rows to the experts' ranks and back (module docstring). Made by ``apply_hf_expert_parallel``."""

    _autopar_ep_mixin = True

    ep: int
    ep_rank: int
    ep_group: str  # group name: a string, so the module deep-copies
    ep_experts: int  # global E; ``num_experts`` is the local El (what the implementations index)

    def forward(self, *args, **kwargs):
        hidden_states, top_k_index, top_k_weights = _call_args(self, args, kwargs)
        return _dispatch(self, hidden_states, top_k_index, top_k_weights, self.num_experts)

    def extra_repr(self) -> str:
        lo = self.ep_rank * self.num_experts
        return (f"ep={self.ep}, ep_rank={self.ep_rank}, local experts [{lo}, {lo + self.num_experts}) "
                f"of {self.ep_experts}")


def _ep_class(cls: type) -> type:
    """The expert-parallel class of a transformers experts class (``mixed_class``)."""
    return mixed_class(HFExpertParallel, cls)


def apply_hf_expert_parallel(experts: nn.Module, prefix: str, ep: int, ep_rank: int, group_name: str | None,
                             block: nn.Module | None = None):
    """Keep this rank's ``E / ep`` experts of one recognized transformers experts module, in
    place (``hf_refusal(experts) is None`` and ``E % ep == 0`` checked by the caller); returns
    ``[(fqn, full_shape)]`` of the sharded parameters (``prefix`` ends with ``experts.``).
    ``ep == 1`` changes nothing."""
    n_experts = experts.num_experts
    n_local = n_experts // ep
    lo, hi = ep_rank * n_local, (ep_rank + 1) * n_local
    sharded = []
    for pname, p in list(experts._parameters.items()):
        if p is None:
            continue
        sharded.append((prefix + pname, tuple(p.shape)))
        if ep > 1:
            # a copy of the slice: the model no longer references the full tensor
            experts._parameters[pname] = nn.Parameter(p.detach()[lo:hi].clone(), requires_grad=p.requires_grad)
    if ep > 1:
        experts.__class__ = _ep_class(type(experts))
        experts.ep, experts.ep_rank, experts.ep_group, experts.ep_experts = ep, ep_rank, group_name, n_experts
        experts.num_experts = n_local
        _register(experts, block, _block_name(prefix), n_experts, n_local)
    return sharded


# -- experts modules of any other form (module docstring) ---------------------------------------------------------


def _count_attrs(module: nn.Module) -> dict[str, int]:
    """The ``num_experts``-like integer attributes of the instance (what its code may read)."""
    return {a: v for a in _COUNT_ATTRS if isinstance(v := module.__dict__.get(a), int) and not isinstance(v, bool)}


def expert_count(module: nn.Module) -> int | None:
    """Global expert count ``E`` of an experts module of either kind (also after the EP
    rewrite): a transformers one's ``num_experts``; for another form its ``num_experts``-like
    attribute, or else the leading dim of its first parameter (None: it has none)."""
    if hasattr(module, "ep_experts"):
        return int(module.ep_experts)
    if is_hf_experts(module):
        return hf_expert_count(module)
    attrs = _count_attrs(module)
    if attrs:
        return next(iter(attrs.values()))
    first = next(iter(module.parameters()), None)
    return int(first.shape[0]) if first is not None and first.dim() >= 1 else None


def _signature(module: nn.Module) -> inspect.Signature:
    return inspect.signature(_first_forward(type(module)))


def signature_refusal(module: nn.Module) -> str | None:
    params = list(_signature(module).parameters.values())[1:]  # without self
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    if len(params) != 3 or any(p.kind not in positional for p in params):
        shown = ", ".join(str(p) for p in params)
        return (f"its forward takes ({shown}), expected exactly three positional tensors (rows [N, d], expert ids "
                "[N, k], routing weights [N, k]; any names)")
    return None


def router_of(block: nn.Module | None, experts: nn.Module, n_experts: int) -> nn.Module | None:
    """The child of ``block`` (other than ``experts``) holding an ``[E, d]`` weight: the router
    that scores the experts, whatever its name (``gate`` and ``router`` first)."""
    if block is None:
        return None
    children = sorted(block.named_children(), key=lambda item: item[0] not in ("gate", "router"))
    for _attr, child in children:
        if child is experts:
            continue
        if any(p.dim() == 2 and p.shape[0] == n_experts for p in child.parameters(recurse=False)):
            return child
    return None


def _hidden_size_candidates(module: nn.Module, block: nn.Module | None, n_experts: int) -> list[int]:
    """``d`` to probe the forward with: the router's ``[E, d]`` weight first, then every
    trailing dim of the experts' parameters."""
    found = []
    router = router_of(block, module, n_experts)
    if router is not None:
        found += [int(p.shape[1]) for p in router.parameters() if p.dim() == 2 and p.shape[0] == n_experts]
    found += [int(s) for p in module.parameters() for s in p.shape[1:]]
    return list(dict.fromkeys(found))


_PROBE_TOKENS = 3
# module -> {(parameter and buffer shapes, count attributes, n_local, d): _probe's answer}: a scan
# runs several times per parallelize (planner, checks, rewrite)
_PROBED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _probe(module: nn.Module, n_local: int, d: int) -> tuple[bool, str | None]:
    key = (tuple((n, tuple(t.shape), t.dtype, t.device.type) for n, t in module.named_parameters()),
           tuple((n, tuple(t.shape)) for n, t in module.named_buffers()), tuple(_count_attrs(module).items()),
           n_local, d)
    memo = _PROBED.setdefault(module, {})
    if key not in memo:
        memo[key] = _run_probe(module, n_local, d)
    return memo[key]


def fake_local_call(module: nn.Module, n_local: int, make_args: Callable):
    """The module's own forward with its parameters sliced to ``n_local`` experts and its
    ``num_experts``-like attributes set to it, on fake tensors ``make_args(dtype, device)``
    (the parameters' floating dtype and device), under the flags torch.export sets (what capture
    runs under: e.g. transformers' grouped_mm then takes its custom op, which has a fake
    kernel). Touches no data, leaves the module as it was, and raises what the forward raises."""
    from torch._export.utils import _compiling_state_context
    from torch._subclasses.fake_tensor import FakeTensorMode

    params = dict(module.named_parameters())
    first = next(iter(params.values()))
    dtype = first.dtype if first.is_floating_point() else torch.get_default_dtype()
    saved = _count_attrs(module)
    try:
        for a in saved:
            setattr(module, a, n_local)
        with _compiling_state_context(), FakeTensorMode(allow_non_fake_inputs=True), torch.no_grad():
            local = {name: p[:n_local] for name, p in params.items()}
            return torch.func.functional_call(module, local, make_args(dtype, first.device))
    finally:
        for a, v in saved.items():
            setattr(module, a, v)


def _run_probe(module: nn.Module, n_local: int, d: int) -> tuple[bool, str | None]:
    """Run the module's own forward as ``run_local_experts`` calls it (``k = 1``, parameters
    sliced to ``n_local`` experts: ``fake_local_call``): ``(data_dependent, why)``, ``why``
    None when it kept the contract."""
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException

    n = _PROBE_TOKENS

    def args(dtype, device):
        return (torch.empty(n, d, dtype=dtype, device=device), torch.zeros(n, 1, dtype=torch.long, device=device),
                torch.empty(n, 1, dtype=dtype, device=device))

    try:
        out = fake_local_call(module, n_local, args)
    except DynamicOutputShapeException as e:
        return True, (f"its forward has a data-dependent shape ({e.func}: e.g. nonzero(), torch.where(mask), a "
                      "boolean mask index or unique()); expert parallelism captures static shapes only: compute "
                      "the experts with a one-hot mask over the experts or gather per-token weights W[top_k_index]")
    except DataDependentOutputException as e:
        return True, (f"its forward reads tensor values on the host ({e.func}: .item(), .tolist(), int()/bool() "
                      "of a tensor, or Python control flow on one), which a static graph cannot hold")
    except Exception as e:  # noqa: BLE001 - the user's code: report what it raised
        return False, (f"its forward fails on hidden_states [{n}, {d}], top_k_index [{n}, 1], top_k_weights "
                       f"[{n}, 1] with {n_local} experts: {type(e).__name__}: {(str(e).splitlines() or [''])[0]}")
    shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
    if shape != (n, d):
        return False, (f"its forward returns {shape} for hidden_states [{n}, {d}], expected one tensor [{n}, {d}] "
                       "(the weighted sum over a token's choices)")
    return False, None


def parameter_refusal(module: nn.Module) -> str | None:
    """Why the parameters of an experts module (not a transformers one) cannot be sharded on
    dim 0, or None: each holds the ``E`` experts on dim 0, the ``num_experts``-like attributes
    agree with ``E``, and no buffer looks per-expert."""
    params = list(module.named_parameters())
    if not params:
        return "it has no parameters (expected the experts' weights stacked on dim 0, [E, ...])"
    n_experts = expert_count(module)
    attrs = _count_attrs(module)
    source = f"{next(iter(attrs))}={n_experts}" if attrs else f"the leading dim of {params[0][0]}"
    for name, p in params:
        if p.dim() < 1 or p.shape[0] != n_experts:
            return (f"parameter {name} has shape {tuple(p.shape)}, expected the {n_experts} experts ({source}) on "
                    "dim 0: every parameter of an experts module is sharded along dim 0")
    for a, v in attrs.items():
        if v != n_experts:
            return f"its {a}={v} differs from its expert count {n_experts} ({source})"
    for name, b in module.named_buffers():
        if b.dim() >= 1 and b.shape[0] == n_experts:
            return (f"buffer {name} {tuple(b.shape)} looks per-expert, and expert parallelism shards parameters "
                    "only: register it as an nn.Parameter(requires_grad=False)")
    return None


def generic_refusal(module: nn.Module, block: nn.Module | None = None, ep: int = 1) -> str | None:
    """Why EP cannot shard this experts module of another form (module docstring), or None
    when it can; ``block`` is the module holding it (its router gives ``d``), ``ep`` the degree
    the forward is probed at (``E / ep`` local experts; the caller checks that ``ep`` divides
    ``E``). Pure: runs the forward on fake tensors only."""
    if isinstance(module, GenericExpertParallel):
        return None  # already rewritten (the caller refuses a second rewrite)
    why = signature_refusal(module) or parameter_refusal(module)
    if why:
        return why
    n_experts = expert_count(module)
    n_local = n_experts // ep
    errors = []
    for d in _hidden_size_candidates(module, block, n_experts):
        data_dependent, why = _probe(module, n_local, d)
        if why is None or data_dependent:
            return why
        errors.append(why)
    return errors[0] if errors else "it has no parameter that gives the hidden size d"


def run_local_experts(module: nn.Module, hidden: torch.Tensor, local_ids: torch.Tensor,
                      weights: torch.Tensor) -> torch.Tensor:
    """The module's OWN forward on rows already on the rank of their experts: ``hidden [M, d]``,
    ``local_ids [M]`` in ``[0, E / ep)``, ``weights [M]`` (0 on padding rows) -> ``[M, d]``,
    row ``m`` the module's result for one token with one choice (``k = 1``). The module holds
    this rank's experts only (parameters sliced, ``num_experts``-like attributes ``E / ep``);
    independent of how the rows were moved here."""
    forward = _first_forward(type(module))
    out = forward(module, hidden, local_ids.unsqueeze(1), weights.unsqueeze(1))
    if not isinstance(out, torch.Tensor) or out.shape != hidden.shape:
        raise ValueError(f"autopar: expert-parallel {type(module).__name__} returned "
                         f"{tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__} for "
                         f"hidden_states {tuple(hidden.shape)}, expected {tuple(hidden.shape)}")
    return out


class LocalExperts:
    """What the expert-parallel mixins of experts modules of other forms share: this rank holds
    experts ``[ep_rank * El, (ep_rank + 1) * El)`` of ``E`` (``keep_local_experts`` sets them)."""

    _autopar_ep_mixin = True
    ep: int
    ep_rank: int
    ep_group: str
    ep_experts: int  # global E
    ep_local: int  # El

    def extra_repr(self) -> str:
        lo = self.ep_rank * self.ep_local
        return f"ep={self.ep}, ep_rank={self.ep_rank}, local experts [{lo}, {lo + self.ep_local}) of {self.ep_experts}"


class GenericExpertParallel(LocalExperts):
    """Mixin over an experts class of another form: ``forward`` takes the module's own arguments
    with global expert ids, moves rows, ids and routing weights to the experts' ranks, runs
    ``run_local_experts`` there and sums each token's ``k`` results back on its own rank.
    Made by ``apply_generic_expert_parallel``."""

    def forward(self, *args, **kwargs):
        hidden_states, top_k_index, top_k_weights = _call_args(self, args, kwargs)
        return _dispatch(self, hidden_states, top_k_index, top_k_weights, self.ep_local)


# (mixin, class) -> the class with the mixin in front: a cache keyed by the two classes, so a class
# is made once per process and every rewritten module of one class shares it; each is also a
# global of this module under its own name, which is what makes the rewritten modules picklable
_MIXED: dict[tuple[type, type], type] = {}


def mixed_class(mixin: type, cls: type) -> type:
    """``cls`` with an expert-parallel ``mixin`` in front, made once and named in this module
    (picklable by name; two user classes of one name get two names)."""
    if (mixin, cls) not in _MIXED:
        name, i = f"ExpertParallel{cls.__name__}", 1
        while name in globals():
            i += 1
            name = f"ExpertParallel{cls.__name__}_{i}"
        new = type(name, (mixin, cls), {"__module__": __name__, "__qualname__": name})
        globals()[name] = new
        _MIXED[mixin, cls] = new
    return _MIXED[mixin, cls]


def _generic_class(cls: type) -> type:
    return mixed_class(GenericExpertParallel, cls)


def keep_local_experts(experts: nn.Module, prefix: str, ep: int, ep_rank: int, group_name: str | None,
                       mixin: type) -> list[tuple[str, tuple[int, ...]]]:
    """Keep this rank's ``E / ep`` experts of an experts module that is not a transformers one,
    in place (its form checked and ``E % ep == 0`` by the caller): every parameter, its
    children's included, becomes a copy of its dim-0 slice (a parameter held twice stays one),
    the ``num_experts``-like attributes become ``E / ep``, and the class gets the form's
    expert-parallel ``mixin`` in front (``ep``, ``ep_rank``, ``ep_group``, ``ep_experts``,
    ``ep_local`` set). Returns ``[(fqn, full_shape)]`` of the sharded parameters (``prefix``
    ends with ``experts.``). ``ep == 1`` changes nothing."""
    n_experts = expert_count(experts)
    n_local = n_experts // ep
    lo, hi = ep_rank * n_local, (ep_rank + 1) * n_local
    sharded = [(prefix + name, tuple(p.shape)) for name, p in experts.named_parameters()]
    if ep > 1:
        copies: dict[int, tuple[nn.Parameter, nn.Parameter]] = {}  # id -> (full, kept alive; local)
        for mod in experts.modules():
            for pname, p in list(mod._parameters.items()):
                if p is None:
                    continue
                if id(p) not in copies:  # a copy of the slice: the model no longer references the full tensor
                    copies[id(p)] = (p, nn.Parameter(p.detach()[lo:hi].clone(), requires_grad=p.requires_grad))
                mod._parameters[pname] = copies[id(p)][1]
        for a in _count_attrs(experts):
            setattr(experts, a, n_local)
        experts.__class__ = mixed_class(mixin, type(experts))
        experts.ep, experts.ep_rank, experts.ep_group = ep, ep_rank, group_name
        experts.ep_experts, experts.ep_local = n_experts, n_local
    return sharded


def apply_generic_expert_parallel(experts: nn.Module, prefix: str, ep: int, ep_rank: int, group_name: str | None,
                                  block: nn.Module | None = None):
    """``keep_local_experts`` for an experts module of another form (``generic_refusal(experts,
    block, ep) is None``), registered for the dropless dispatch op."""
    sharded = keep_local_experts(experts, prefix, ep, ep_rank, group_name, GenericExpertParallel)
    if ep > 1:
        _register(experts, block, _block_name(prefix), experts.ep_experts, experts.ep_local)
    return sharded
