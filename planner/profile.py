"""From a model to the planner's per-unit costs: capture once, cut at block boundaries, trace
each distinct block's joint graph once.

A *unit* is the smallest piece a pipeline stage is made of: the prologue (everything before
the first block, e.g. embeddings), one block (``layers.7``), or the epilogue (final norm, head
and loss). Stage boundaries fall between units. Units whose graphs are identical (same ops on
the same shapes) share one joint trace, so a 126-layer model costs one block's trace.

Everything is per *sample* of the captured microbatch (the capture uses microbatch size
``batch0``; every op of the supported models is linear in the batch dimension, so a
microbatch of b samples costs b/batch0 times the captured one):

* F/I/W programs as node lists (FLOPs, bytes moved, dtype, whether it is a pure view) so a
  device profile turns them into times (``UnitKind.times``); for a model on real CPU tensors
  priced on the measured ``cpu`` profile, the programs themselves are timed on this machine
  at two microbatch sizes instead (``UnitTimer``; costs one more capture, on first use);
* saved activations: distinct storages the F program keeps for I and W (views of parameters
  and aliases of one another counted once), including the unit's input activations when I or
  W read them (the runtime keeps them in the microbatch's env after F, like a saved value),
  and what W still needs after I: the saved values it reads plus the ones I computes for it
  (e.g. the gradients of linear-layer outputs that dW = dY^T X needs), which can exceed what F
  saved;
* the transient working set: the largest live set of the backward's (and the forward's)
  intermediate activations, views keeping their base alive, WITHOUT the parameter gradients
  the backward returns (those are parameter-sized, not batch-sized: the estimate counts a
  stage's gradient outputs separately);
* the boundary tensors (what a stage receives and sends), parameter counts and bytes,
  expert parameters (split by EP), attention bytes (moved by Ulysses CP all-to-alls) and the
  MoE dispatch bytes (moved by EP all-to-alls): a static-capacity MoE's expert buffers, or a
  dropless MoE's routed rows read off its ``autopar::moe_dispatch`` ops (``RoutedInfo``).

MoE models: a Hugging Face experts module (or one of another form that expert parallelism
shards) is captured as the dropless dispatch op EP runs (``passes.expert_parallel.dispatch_form``,
at ep = 1), so it is priced like ``autopar.nn.MoE(capacity_factor=None)`` and the presets' MoE: from the op.

Models built on the meta device are captured on fake CPU tensors: no memory, and SDPA lowers
to the flash kernel (saves q, k, v, out, logsumexp), as it does on GPUs, rather than to the
math path that would keep the T x T scores.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Sequence

import torch
import torch.fx as fx

from autopar.collectives import moe_exchange
from autopar.passes.costs import is_view as _is_view
from autopar.passes.costs import value_bytes
from autopar.passes.costs import view_base as _base
from autopar.passes.cp_rules import grouped_kv_heads
from autopar.passes.zero_layout import ParamSpec, ns_flops

from .programs import Program, is_attention_fwd, live_set, program_of, storage_bytes, units_of
from .routed import check_moe, routed_of
from .tp_share import TP_EFFICIENCY, TP_WORTH, with_tp_shares
from .unit_kind import Unit, UnitKind
from .unit_timer import UnitTimer


@dataclass
class ModelProfile:
    name: str
    units: list[Unit]
    batch0: int                    # samples in the captured microbatch
    seq_len: int | None            # tokens per sample (None for non-sequence models)
    n_heads: int = 0               # attention heads (for CP divisibility); 0 = unknown
    n_experts: int = 0
    capture_s: float = 0.0
    trace_s: float = 0.0
    tied_params: int = 0           # parameter elements counted in two units (tied embedding/head)
    # parameters held by more than one unit: (unit indices, elements); a rank holding several of
    # those units stores one copy (one weight, one gradient, one optimizer state)
    shared_params: tuple[tuple[tuple[int, ...], int], ...] = ()
    captured: object = field(default=None, repr=False)
    unit_timer: object = field(default=None, repr=False)  # times the units on this machine (real CPU captures)
    tp_variants: dict = field(default_factory=dict, repr=False, compare=False)  # tp -> at_tp(tp), memoized
    # the same model with its LM head + cross-entropy chunked (passes/chunked_loss.py) at
    # ``loss_chunk_tokens``: its last unit is the chunked epilogue; None when the loss is of
    # another form (or this is that profile)
    chunked: "ModelProfile | None" = field(default=None, repr=False)
    loss_chunk_tokens: int = 0
    # plans from this profile run their programs compiled by Inductor (Plan.compile); a measured
    # profile (the cpu device) timed its units compiled
    compiled: bool = False
    variants: dict = field(default_factory=dict, repr=False, compare=False)  # "remade" -> the profile, memoized

    @property
    def remade(self) -> "ModelProfile | None":
        """The same model with every stage's backward making element-wise values again
        (``UnitKind.remaking``; the chunked variant too, its chunked epilogue as it is); None
        when no unit has that variant (a compiled profile is already in that form)."""
        if not any(u.kind.remade is not None for u in self.units):
            return None
        if "remade" not in self.variants:
            kinds = {}

            def remade(units):
                return [replace(u, kind=kinds.setdefault(id(u.kind), u.kind.remaking())) for u in units]

            units = remade(self.units)
            chunked = None
            if self.chunked is not None:
                chunked = replace(self.chunked, units=remade(self.chunked.units[:-1]) + self.chunked.units[-1:],
                                  tp_variants={}, variants={})
            self.variants["remade"] = replace(self, units=units, chunked=chunked, tp_variants={}, variants={})
        return self.variants["remade"]

    def at_tp(self, tp: int) -> "ModelProfile":
        """The model as one rank of a tensor-parallel group of ``tp`` sees it: every unit's kind
        ``UnitKind.at_tp``, its sharded parameters' shapes divided (the ZeRO layouts), the
        chunked variant likewise (memoized)."""
        if tp == 1:
            return self
        hit = self.tp_variants.get(tp)
        if hit is None:
            kinds = {}
            units = []
            for u in self.units:
                k = kinds.setdefault(id(u.kind), u.kind.at_tp(tp))
                sh = dict(u.kind.tp_share(tp).sharded) if u.kind.tp_share(tp) is not None else {}
                specs = tuple(_spec_at_tp(p, u.name, sh, tp) for p in u.params)
                units.append(replace(u, kind=k, params=specs))
            hit = replace(self, units=units, chunked=self.chunked.at_tp(tp) if self.chunked is not None else None,
                          tp_variants={}, variants={})
            self.tp_variants[tp] = hit
        return hit

    @property
    def foldable(self) -> bool:
        """Whether its experts may fold over tp ranks: every MoE unit dispatches dropless
        (priced by its routed rows); a static-capacity block refuses to fold
        (passes/expert_parallel.py), so with tp > 1 it keeps ep = 1."""
        return not any(u.kind.dispatch_bytes and u.kind.routed is None for u in self.units)

    def shards_at(self, tp: int) -> bool:
        """Whether tensor parallelism at ``tp`` is worth searching: with a share s of the
        forward's time sharded, tp ranks do the useful work of at best 1 / (tp (1 - s) + s) of
        them (each runs the unsharded rest whole); searched where that is at least
        ``TP_EFFICIENCY``, or where it shards at least ``TP_WORTH`` of the parameters (it may fit
        a model nothing else fits). MoE models whose experts it leaves to expert parallelism
        (GLM-5, DeepSeek-V3: their latent attention, 45-49% of the time at 4096 tokens, 2% of the
        parameters: 64-66% at tp=2) are not searched; at longer sequences, where attention weighs
        more, they are. ``--pin tp=`` prices any degree (with ep > 1 the experts then fold over the
        tp ranks: DeepSeek-V3's 1,024-GPU recipe at tp=2, pp=16, ep=64, dp=32 is priced so;
        counting the folded experts as sharded here would search tp for every MoE model, about
        doubling DeepSeek-V3's search, and on that request still chose the tp=1 plan)."""
        flops = sum(u.kind.f.total_flops for u in self.units) or 1.0
        params = self.total_params or 1
        time = sum(sh.flops * u.kind.f.total_flops for u in self.units if (sh := u.kind.tp_share(tp)) is not None)
        held = sum(sh.params for u in self.units if (sh := u.kind.tp_share(tp)) is not None)
        s = time / flops
        return 1.0 / (tp * (1.0 - s) + s) >= TP_EFFICIENCY or held / params >= TP_WORTH

    def retime_units(self, budget_s: float = 0.3) -> list | None:
        """Time every distinct unit's programs again, now (see ``UnitTimer``); returns the new
        measurements without changing the ones the planner prices with (None: not timeable)."""
        if self.unit_timer is None:
            return None
        return self.unit_timer.measure_again(budget_s)

    def use_unit_times(self, measurements: list) -> None:
        """Price from now on with ``measurements`` (e.g. per-program medians of several
        ``retime_units``); Evaluators made before keep the unit times they cached."""
        self.unit_timer.result = list(measurements)
        for k in self.kinds:
            k.__dict__.pop("_measured", None)

    @property
    def total_params(self) -> int:
        return sum(u.kind.params for u in self.units) - self.tied_params

    @property
    def kinds(self) -> list[UnitKind]:
        seen, out = set(), []
        for u in self.units:
            if id(u.kind) not in seen:
                seen.add(id(u.kind))
                out.append(u.kind)
        return out

    def runs(self) -> list[tuple[UnitKind, int]]:
        """Consecutive units of the same kind, as (kind, count)."""
        out: list[tuple[UnitKind, int]] = []
        for u in self.units:
            if out and out[-1][0] is u.kind:
                out[-1] = (u.kind, out[-1][1] + 1)
            else:
                out.append((u.kind, 1))
        return out

    def flops_per_sample(self) -> float:
        return sum(u.kind.f.total_flops + u.kind.i.total_flops + u.kind.w.total_flops for u in self.units) / self.batch0


def _spec_at_tp(spec: ParamSpec, unit: str, sharded: dict, tp: int) -> ParamSpec:
    """A parameter's shape on one tp rank (``sharded``: FQN relative to the unit -> dim)."""
    dim = sharded.get(spec.fqn[len(unit):] if spec.fqn.startswith(unit + ".") else spec.fqn)
    if dim is None:
        return spec
    shape = list(spec.shape)
    shape[dim] //= tp
    return ParamSpec(spec.fqn, tuple(shape))


def _param_specs(stage) -> tuple[ParamSpec, ...]:
    """The stage's parameters (canonical FQNs, traced shapes)."""
    phs = [n for n in stage.gm.graph.nodes if n.op == "placeholder"][: len(stage.params)]
    return tuple(ParamSpec(fqn, tuple(ph.meta["val"].shape)) for fqn, ph in zip(stage.params, phs))


def _experts(specs, is_expert) -> frozenset:
    return frozenset(s.fqn for s in specs if is_expert(s.fqn))


def _fakeify(model: torch.nn.Module, inputs: tuple, target, param_dtype=None):
    """Meta modules/tensors -> fake CPU ones (no storage), floating parameters cast to
    ``param_dtype`` if given; a real model without a dtype is returned unchanged."""
    metas = [t.is_meta for t in list(model.parameters()) + list(model.buffers())]
    metas += [x.is_meta for x in inputs if isinstance(x, torch.Tensor)]
    if not any(metas) and param_dtype is None:
        return model, inputs, target
    import copy

    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    # a copy: to_empty works in place, and the caller's model must stay as it is
    model = copy.deepcopy(model) if any(metas) else copy.deepcopy(model).to("meta")
    tied = {}
    for fqn, p in model.named_parameters(remove_duplicate=False):
        tied.setdefault(id(p), []).append(fqn)
    with mode:
        model = model.to_empty(device="cpu")
        for names in tied.values():  # to_empty makes a Parameter per module: tie them again
            first = model.get_parameter(names[0])
            for name in names[1:]:
                path, _, attr = name.rpartition(".")
                (model.get_submodule(path) if path else model)._parameters[attr] = first
        if param_dtype is not None:
            for p in model.parameters():
                if p.is_floating_point():
                    p.data = p.data.to(param_dtype)
        inputs = tuple(torch.empty_like(x, device="cpu") if isinstance(x, torch.Tensor) else x for x in inputs)
        if isinstance(target, torch.Tensor):
            target = torch.empty_like(target, device="cpu")
    return model, inputs, target


def _signature(stage) -> tuple:
    sig = []
    for n in stage.gm.graph.nodes:
        val = n.meta.get("val")
        shape = tuple(val.shape) if isinstance(val, torch.Tensor) else None
        dtype = str(val.dtype) if isinstance(val, torch.Tensor) else None
        sig.append((n.op, str(n.target) if n.op != "placeholder" else "", shape, dtype))
    return tuple(sig)


def _unit_kind(label: str, sp, stage, expert_names: Callable[[str], bool], measure=None,
               routes: dict | None = None) -> UnitKind:
    from autopar.passes import keys

    f_state = {n.name for n, k in zip((n for n in sp.f.gm.graph.nodes if n.op == "placeholder"), sp.f.args)
               if keys.is_state(k)}
    f_out = next(n for n in sp.f.gm.graph.nodes if n.op == "output")
    saved_nodes = [v for v, k in zip(f_out.args[0], sp.f.results) if keys.is_kind(k, keys.SAVED)]
    # stage inputs that I, W or B read stay in the microbatch env after F, like saved values
    later = set(sp.i.args) | set(sp.w.args) | set(sp.b.args)
    f_phs = [n for n in sp.f.gm.graph.nodes if n.op == "placeholder"]
    kept_inputs = [n for n, k in zip(f_phs, sp.f.args) if keys.is_kind(k, keys.INPUT) and k in later]
    saved = storage_bytes(saved_nodes + kept_inputs, f_state)
    w_phs = [n for n in sp.w.gm.graph.nodes if n.op == "placeholder"]
    w_state = {n.name for n, k in zip(w_phs, sp.w.args) if keys.is_state(k)}
    after_i = storage_bytes([n for n, k in zip(w_phs, sp.w.args) if not keys.is_state(k)
                              and not keys.is_kind(k, keys.GRAD)], w_state)
    from_f = {**dict(zip(sp.f.args, f_phs)), **dict(zip(sp.f.results, f_out.args[0]))}
    # what only W reads of what F kept, by storage: a storage I also reads (through any value
    # viewing it) comes back for I (runtime/offload.py parks and brings back whole storages)
    i_bases = {_base(from_f[k]).name for k in sp.i.args if k in from_f}
    w_only = storage_bytes([from_f[k] for k in sp.w.args if k in from_f and k not in sp.i.args
                             and k not in sp.i.results and (keys.is_kind(k, keys.SAVED) or keys.is_kind(k, keys.INPUT))
                             and _base(from_f[k]).name not in i_bases], f_state)
    phs = [n for n in stage.gm.graph.nodes if n.op == "placeholder"]
    vals = {n.name: n.meta.get("val") for n in phs}
    n_state = len(stage.params)
    params = sum(vals[n.name].numel() for n in phs[:n_state])
    pbytes = sum(value_bytes(vals[n.name]) for n in phs[:n_state])
    expert = sum(vals[n.name].numel() for n, fqn in zip(phs[:n_state], stage.params) if expert_names(fqn))
    small = sum(vals[n.name].numel() for n, fqn in zip(phs[:n_state], stage.params)
                if vals[n.name].dim() < 2 and not expert_names(fqn))
    muon = {"params": 0, "expert_params": 0, "flops": 0.0, "expert_flops": 0.0}
    for n, fqn in zip(phs[:n_state], stage.params):
        if routes is not None and fqn in routes and routes[fqn].muon:
            part = "expert_" if expert_names(fqn) else ""
            muon[part + "params"] += vals[n.name].numel()
            muon[part + "flops"] += float(ns_flops(tuple(vals[n.name].shape)))
    in_bytes = float(stage.bytes_in)
    out_bytes = float(stage.bytes_out)
    attn = 0.0
    grouped_kv = []
    dispatch = 0.0
    expert_ph = {n.name for n, fqn in zip(phs[:n_state], stage.params) if expert_names(fqn)}
    for n in stage.gm.graph.nodes:
        if n.op != "call_function":
            continue
        if is_attention_fwd(n):
            attn += sum(a.meta.get("autopar_bytes", 0) for a in n.all_input_nodes[:3])
            attn += value_bytes(n.meta.get("val") if not isinstance(n.meta.get("val"), tuple) else n.meta["val"][0])
            hk = grouped_kv_heads(n)
            if hk:
                k, v = n.all_input_nodes[1:3]
                grouped_kv.append((hk, float(k.meta.get("autopar_bytes", 0) + v.meta.get("autopar_bytes", 0))))
        elif expert_ph and n.target in (torch.ops.aten.bmm.default, torch.ops.aten.baddbmm.default):
            w = _base(n.args[-1]) if isinstance(n.args[-1], fx.Node) else n.args[-1]
            if isinstance(w, fx.Node) and w.name in expert_ph and isinstance(n.args[-2], fx.Node):
                dispatch = max(dispatch, float(n.args[-2].meta.get("autopar_bytes", 0)))
    # dispatch: the largest expert input buffer of the unit, sent out and combined back once per MoE
    # transient: the backward's intermediates (and input gradients) without the parameter
    # gradients it returns; the forward's rise above what it leaves behind (saved + outputs)
    b_peak, _ = live_set(sp.b.gm, sp.b.results, skip=(keys.GPARAM,))
    f_peak, f_end = live_set(sp.f.gm, sp.f.results)
    return UnitKind(kind=label, f=_program(sp.f, expert_names), i=_program(sp.i, expert_names),
                    w=_program(sp.w, expert_names),
                    saved_bytes=saved, saved_after_i=after_i,
                    in_bytes=in_bytes, out_bytes=out_bytes, params=int(params), param_tensors=n_state,
                    small_params=int(small),
                    param_bytes=int(pbytes),
                    expert_params=int(expert), attention_bytes=float(attn), dispatch_bytes=dispatch,
                    work_bytes=max(b_peak, f_peak - f_end), measure=measure, saved_w_only=w_only,
                    grouped_kv=tuple(grouped_kv),
                    **{"muon_" + k: v for k, v in muon.items()})


def _with_routed(kind: UnitKind, sp) -> UnitKind:
    """``kind`` with its dropless MoE dispatch read off the F program (``routed_of``: its chains
    spread, passes/moe_overlap.py), whose routed state F keeps and, after I, the received rows'
    output gradients for W (row_bytes a row); itself without one."""
    routed = routed_of(sp.f.gm)
    if routed is None:
        return kind
    return replace(kind, routed=routed, dispatch_bytes=routed.rows * routed.row_bytes,
                   saved_bytes=kind.saved_bytes + routed.saved_bytes,
                   saved_after_i=kind.saved_after_i + routed.rows * (routed.saved_row_bytes + routed.row_bytes))


def _program(prog, is_expert: Callable[[str], bool]) -> Program:
    """``program_of`` one stage program, told which of its inputs are expert weights and which
    of its results their gradients (their bytes are 1/ep on an expert-parallel rank)."""
    from autopar.passes import keys

    nodes = list(prog.gm.graph.nodes)
    phs = [n for n in nodes if n.op == "placeholder"]
    experts = frozenset(n.name for n, k in zip(phs, prog.args)
                        if keys.is_kind(k, keys.PARAM) and is_expert(keys.name_of(k, keys.PARAM)))
    ret = next(n for n in nodes if n.op == "output").args[0]
    vals = ret if isinstance(ret, (tuple, list)) else (ret,)
    grads = frozenset(v.name for v, k in zip(vals, prog.results) if isinstance(v, fx.Node)
                      and keys.is_kind(k, keys.GPARAM) and is_expert(keys.name_of(k, keys.GPARAM)))
    return program_of(prog.gm, experts, grads)


def attention_heads(gm: torch.fx.GraphModule) -> int:
    """The largest head count cp must divide for every attention (0 without attention): context
    parallelism (Ulysses) shards heads (``context_parallel.cp_heads``: the query heads of a
    grouped-query SDPA, else what its q, k and v heads all divide)."""
    from autopar.passes.cp_rules import ATTENTION_OPS, cp_heads

    heads = 0
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in ATTENTION_OPS:
            heads = math.gcd(heads, cp_heads(node))
    return heads


def profile_model(model: torch.nn.Module, inputs: tuple, target=None, loss_fn=None, *, name: str = "model",
                  layer_repeats: dict[str, int] | None = None, expert_prefixes: Sequence[str] = ("expert",),
                  n_heads: int = 0, n_experts: int = 0, seq_len: int | None = None,
                  progress: Callable[[str], None] | None = None, param_dtype=None,
                  input_names=None, moe: dict | None = None, compile: bool = False) -> ModelProfile:
    """Capture ``model`` on one microbatch and cost every unit (see the module docstring).

    ``layer_repeats`` maps a block path of the built model to the number of real layers it
    stands for (presets are built with one block per kind); blocks not named stand for one.
    Units holding dropless MoE blocks (``autopar::moe_dispatch`` ops: ``autopar.nn.MoE(
    capacity_factor=None)``, the presets' MoE) are priced from those ops (``routed_of``): their
    routed rows set the all-to-all volume and the imbalance terms, and the rows' saved bytes
    (the op's dynamic state, which no saved graph value holds) are added to what the unit keeps
    from F to I and W (``saved_bytes``; ``saved_after_i`` also holds the rows' output gradients
    that I leaves for W), so the estimate holds them per microbatch in flight. ``moe``: a
    preset's dropless MoE config (``PresetModel.moe``), checked against the capture
    (``check_moe``); None: no check. ``compile``: plans from this profile run compiled
    (``ModelProfile.compiled``); a model on real CPU tensors has its units timed compiled by
    Inductor (the first round compiles each, untimed). Analytic device profiles price the same
    ops either way (fusion is not modelled).
    """
    from autopar.passes import expert_parallel, keys
    from autopar.passes.capture import capture
    from autopar.passes.optimizer_routing import route_parameters
    from autopar.passes.program import StageProgram
    from autopar.passes.split_backward import stage_programs

    say = progress or (lambda msg: None)
    if not isinstance(inputs, (tuple, list)):
        inputs = (inputs,)
    inputs = tuple(inputs)
    batch0 = int(inputs[0].shape[0]) if inputs and isinstance(inputs[0], torch.Tensor) and inputs[0].dim() else 1
    if seq_len is None and inputs and isinstance(inputs[0], torch.Tensor) and inputs[0].dim() >= 2:
        seq_len = int(inputs[0].shape[1])
    t0 = time.perf_counter()
    say(f"capturing {name} ...")
    with expert_parallel.dispatch_form(model):  # a user's experts modules as the dispatch op EP runs
        fmodel, finputs, ftarget = _fakeify(model, inputs, target, param_dtype)
        captured = capture(fmodel, finputs, ftarget, loss_fn, input_names)
    capture_s = time.perf_counter() - t0
    say(f"captured {name} in {capture_s:.1f} s: {captured.summary()}")

    # the dispatch ops of the capture find their experts modules' entries while the units are
    # traced, priced and timed (collectives/moe_exchange.py)
    entries = {**moe_exchange.entries_of(model), **moe_exchange.entries_of(fmodel)}
    with moe_exchange.serving(entries):
        if not n_heads:  # e.g. `autopar plan --model pkg:factory`: read them off the attention ops
            n_heads = attention_heads(captured.gm)
        cuts, labels, stages = units_of(captured)
        routes = route_parameters(captured)  # what autopar.Muon would step (priced under --optimizer muon)
        t1 = time.perf_counter()
        trainable = set(captured.params.values())
        kinds: dict[tuple, UnitKind] = {}
        unit_kinds = []
        is_expert = (lambda fqn: any(p in fqn for p in expert_prefixes)) if expert_prefixes else (lambda fqn: False)
        # real CPU tensors (not a fake/meta capture): units can be timed on this machine
        real = fmodel is model and all(t.device.type == "cpu" for t in model.parameters())
        state, data = {}, {}
        timer = UnitTimer(state, data, entries, compiled=compile)
        if real:
            timer.second_batch(model, inputs, target, loss_fn, batch0, labels, input_names)
            state.update(keys.state(dict(model.named_parameters(remove_duplicate=False)), dict(model.named_buffers()),
                                    captured.constants))
            data.update(zip(captured.inputs, inputs))
            if captured.target is not None:
                data[captured.target] = target
        sigs: dict[int, tuple] = {}  # unit -> its signature
        seen: set[tuple] = set()

        def first_of_its_kind(st, requires: dict) -> bool:
            """Units with identical graphs and input gradients share one joint trace."""
            sig = sigs[st.index] = (_signature(st), tuple(requires.get(n, False) for n in st.inputs))
            new = sig not in seen
            seen.add(sig)
            return new

        last_requires: dict = {}  # which inputs of the last unit carry a gradient
        # the units as the plans run them by default: eager stages keep their element-wise
        # values, compiled ones make them again (Plan.remake); an eager profile also holds each
        # kind's remaking variant (UnitKind.remade), which the search takes where memory binds
        split = stage_programs(stages, trainable, held=first_of_its_kind, remake=None if compile else (),
                               also_remade=not compile)
        for st, label, sp in zip(stages, labels, split):
            sp, again = sp if isinstance(sp, tuple) else (sp, None)
            if st.index == len(stages) - 2:
                last_requires = {name: True for name in sp.diff_outputs}
            sig = sigs[st.index]
            if isinstance(sp, StageProgram):
                unit_label = label or ("prologue" if st.index == 0 else "epilogue")
                measure = timer.add(sp, st) if real else None
                kind = _with_routed(_unit_kind(unit_label, sp, st, is_expert, measure=measure, routes=routes), sp)
                if again is not None:
                    again_kind = _unit_kind(unit_label, again, st, is_expert, routes=routes)
                    kind = replace(kind, remade=_with_routed(again_kind, again))
                kinds[sig] = kind
            unit_kinds.append(kinds[sig])
        unit_kinds = with_tp_shares(captured, stages, labels, unit_kinds)
        chunked_kind, chunk = _chunked_epilogue(stages[-1], last_requires, trainable, unit_kinds[-1], is_expert,
                                                timer if real else None, compile)
        if chunked_kind is not None:  # under tp the chunked head shards as the captured one (vocabulary-parallel)
            chunked_kind = replace(chunked_kind, tp_shares=unit_kinds[-1].tp_shares)
    trace_s = time.perf_counter() - t1
    say(f"traced {len(kinds)} distinct unit graphs of {len(stages)} units in {trace_s:.1f} s")
    if moe:
        check_moe(moe, list(kinds.values()), batch0 * (seq_len or 1))

    repeats = dict(layer_repeats or {})
    units: list[Unit] = []
    counters: dict[str, int] = {}
    first_unit: list[int] = []  # captured unit (stage) k -> index of its first unit in `units`
    for k, (label, kind, st) in enumerate(zip(labels, unit_kinds, stages)):
        first_unit.append(len(units))
        cut = 0 if k == 0 else cuts[k - 1]
        specs = _param_specs(st)
        muon = [routes[s.fqn].muon if s.fqn in routes else False for s in specs]
        if label is None:
            units.append(Unit("prologue" if k == 0 else "epilogue", kind, cut, specs, _experts(specs, is_expert),
                              frozenset(s.fqn for s, m in zip(specs, muon) if m)))
            continue
        container = label.rsplit(".", 1)[0]
        n = repeats.get(label, 1)
        for _ in range(n):
            idx = counters.get(container, 0)
            counters[container] = idx + 1
            unit = f"{container}.{idx}"
            renamed = tuple(ParamSpec(unit + s.fqn[len(label):] if s.fqn.startswith(label + ".") else s.fqn, s.shape)
                            for s in specs)
            units.append(Unit(unit, kind, cut if n == 1 and not layer_repeats else None, renamed,
                              _experts(renamed, is_expert), frozenset(s.fqn for s, m in zip(renamed, muon) if m)))
    tied = sum(len(v) - 1 for v in captured.aliases.values())
    tied_elems = 0
    if tied:
        ph_vals = {n.name: n.meta.get("val") for n in captured.gm.graph.nodes if n.op == "placeholder"}
        holders: dict[str, int] = {}
        for st in stages:
            for fqn in st.params:
                holders[fqn] = holders.get(fqn, 0) + 1
        by_fqn = {fqn: ph_vals[ph] for ph, fqn in captured.params.items()}
        tied_elems = sum((holders[f] - 1) * by_fqn[f].numel() for f in holders if holders[f] > 1)
    # parameters several units use (tied embedding/head, reused modules): one copy per rank
    ph_vals = {n.name: n.meta.get("val") for n in captured.gm.graph.nodes if n.op == "placeholder"}
    numel = {fqn: ph_vals[ph].numel() for ph, fqn in captured.params.items()}
    held_by: dict[str, list[int]] = {}
    for k, st in enumerate(stages):
        for fqn in st.params:
            held_by.setdefault(fqn, []).append(first_unit[k])
    shared = tuple((tuple(us), int(numel.get(fqn, 0))) for fqn, us in sorted(held_by.items()) if len(us) > 1)
    profile = ModelProfile(name=name, units=units, batch0=batch0, seq_len=seq_len, n_heads=n_heads,
                           n_experts=n_experts, capture_s=capture_s, trace_s=trace_s, tied_params=tied_elems,
                           shared_params=shared, captured=captured,
                           unit_timer=timer if real else None, compiled=compile)
    if chunked_kind is not None:
        last = units[-1]
        profile.chunked = replace(profile, units=units[:-1] + [replace(last, kind=chunked_kind)],
                                  loss_chunk_tokens=chunk, tp_variants={}, variants={})
    return profile


def _chunked_epilogue(stage, requires: dict, trainable: set, plain: UnitKind, is_expert, timer, remake: bool):
    """(the last unit's kind with its LM head + cross-entropy chunked, the chunk in tokens), or
    (None, 0) when the unit has no such loss (``remake``: as ``split_backward``'s). The chunk:
    ``linear_ce.default_chunk`` of the vocabulary; its buffers inside the ops (not graph values)
    are the kind's fixed working set."""
    from autopar import linear_ce
    from autopar.passes.chunked_loss import chunk_stage_loss, find_linear_losses
    from autopar.passes.split_backward import split_backward

    found = find_linear_losses(stage.gm) if stage.has_loss else []
    if not found:
        return None, 0
    m = max(found, key=lambda f: f.vocab)
    chunk = linear_ce.default_chunk(m.vocab)
    head = m.head.meta["val"]
    fp32_steps = sum(1 for n in m.chain if n.meta["val"].dtype == torch.float32 and not _is_view(n))
    row = linear_ce.working_bytes_per_token(m.vocab, head.element_size(), fp32_steps)
    chunked = chunk_stage_loss(stage, chunk)
    sp = split_backward(chunked, requires, trainable, remake=remake)
    kind = _unit_kind(plain.kind, sp, chunked, is_expert, measure=timer.add(sp, chunked, chunk) if timer else None)
    # the weight gradient: added into its accumulator chunk by chunk, in place at fp32
    # (passes/exec_code.py); a narrower head's chunk GEMM makes a [vocab, d] temporary; with a
    # bias the op returns a fresh fp32 gradient
    w = m.head.args[1].meta["val"]
    has_bias = len(m.head.args) > 2 and m.head.args[2] is not None
    fixed = 4 * w.numel() if has_bias else (w.numel() * w.element_size() if w.element_size() < 4 else 0)
    return replace(kind, loss_chunk_row_bytes=float(row), loss_chunk=chunk, loss_tokens=m.tokens,
                   muon_params=plain.muon_params, muon_expert_params=plain.muon_expert_params,
                   muon_flops=plain.muon_flops, muon_expert_flops=plain.muon_expert_flops,
                   loss_fixed_bytes=float(fixed)), chunk
