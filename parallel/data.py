"""Data parallelism, ZeRO 0-3 and mixed precision over the dp*cp replicas of each pipeline
rank: one owner.

``DataParallel`` holds, for the parameters this process trains:

* where gradients accumulate (``grads``, runtime/stage_work.ParamGrads): each parameter's
  ``.grad``; under mixed precision the fp32 masters' ``.grad`` (ZeRO-0) or fp32 buffers
  (ZeRO-1); ZeRO-2/3 add each fresh gradient into its layer group's flat fp32 buffer instead
  (``grad_sink``, runtime/sharded.py);
* the gradient reduction the executor drives (``begin_step``, ``stage_done`` after a stage's
  last W/B of the step, ``finish`` after the pipeline), in the reduce dtype: ZeRO-0 sums every
  gradient over the replicas (bucketed and overlapped, runtime/grad_reduce.py, or the naive
  oracle); ZeRO-1 leaves it to its optimizer (reduce-scatter, step the shard, all-gather:
  runtime/zero.py); ZeRO-2/3 reduce-scatter a group once its last W ran. Expert-parallel
  shards go through the same machinery over the *expert-data-parallel* group
  (``mesh.expert_group``: the dp*cp/ep replicas that hold the same experts) instead of the
  dp*cp replicas: ZeRO-1/2/3 shard their fp32 masters and optimizer state (and ZeRO-2/3 their
  gradients, ZeRO-3 their weights) over it, in sets and groups of their own (one collective
  never mixes the two process groups). Under ZeRO-0, or when that group is one rank
  (ep == dp*cp), an expert shard is summed over it and stepped whole beside the rest;
* the masters the optimizer steps: the parameters themselves (fp32 training, ZeRO-0), fp32
  copies (mixed precision, ZeRO-0), the ZeRO-1 flat shard, the ZeRO-2/3 group shards; and the
  compute copies the programs read (``param_dtype`` under mixed precision), refreshed from the
  masters after every step;
* the ZeRO-2/3 layout (passes/zero_layout.py) and its storage, and ZeRO-3's program rewrite
  (passes/zero_stream.py);
* the user's optimizer, wrapped for the ZeRO level;
* the mapping between its masters and whole parameters (``whole`` / ``load_whole``), and
  for checkpoints where each master lies in its parameters (``local_shards``). An expert
  shard's pieces are in the coordinates of the shard this rank holds (its ``E/ep`` rows);
  ExpertParallel (parallel/expert.py) places them in the whole tensor. Whole values: ZeRO-3's
  streamed expert shards are freed here, so ``whole`` gathers them over the expert-data-
  parallel group and then over the EP group (ExpertParallel skips freed shards), and
  ``load_whole`` takes this rank's rows of the whole values.

In local mode (no mesh) there is one replica: no reduction, ZeRO off, mixed precision as
above. The loss tangent already carries 1/(dp*m*cp): every reduction is a plain sum.
"""
from __future__ import annotations

import math

import torch

from autopar.collectives import comms
from autopar.passes.zero_layout import ParamSpec, layer_group, whole_matrices, zero_layout
from autopar.passes.zero_stream import stream_parameters
from autopar.runtime.grad_reduce import BucketedReducer, naive_all_reduce
from autopar.runtime.materialize import assign
from autopar.runtime.optim import WrappedOptimizer
from autopar.runtime.sharded import ShardedOptimizer, ShardedParameters
from autopar.runtime.stage_work import ParamGrads
from autopar.runtime.zero import ZeroOneOptimizer

from .base import Parallelism, Shard


class _Buffers(ParamGrads):
    """Mixed precision's fp32 gradient accumulators: the ``.grad`` of the fp32 masters stepped
    whole (``masters``: ZeRO-0's every parameter, an expert shard stepped whole beside the
    ZeRO shards), else fp32 buffers attached to no parameter (ZeRO-1's flat sets read them)."""

    def __init__(self, like: dict[str, torch.Tensor], masters: dict[str, torch.nn.Parameter] | None = None):
        super().__init__(masters or {})
        self.like, self.buffers = like, {}

    def accumulator(self, fqn: str) -> torch.Tensor:
        if fqn in self.tensors:
            return super().accumulator(fqn)
        g = self.buffers.get(fqn)
        if g is None:
            p = self.like[fqn]
            g = self.buffers[fqn] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
        return g

    def add(self, fqn: str, g: torch.Tensor) -> None:
        self.accumulator(fqn).add_(g)

    def zero(self) -> None:
        super().zero()
        self.buffers = {}


class DataParallel(Parallelism):
    name = "dp"

    def __init__(self, *, zero: int, mesh, model, params: dict[str, torch.nn.Parameter], stage_params: dict[int, tuple],
                 expert_params: frozenset[str] = frozenset(), grad_reduce: str = "bucketed",
                 bucket_bytes: int = 25 * 2**20, timeout=None, comm=None, precision=None, values=None,
                 device: torch.device | None = None, options: dict[str, dict] | None = None, owner_of=None,
                 tp_sharded: frozenset[str] = frozenset()):
        """``params``: canonical FQN -> Parameter (model order; the held ones real, the dict is
        kept current as compute copies replace them); ``stage_params``: this process's stage
        index -> the FQNs its programs compute gradients of; ``precision``: an
        ``autopar.MixedPrecision`` or None; ``values(fqns)``: whole values of parameters that are
        not materialized (ZeRO-3 streamed groups of a meta model); ``options``: FQN -> the options
        of its parameter group (``weight_decay``, ...; default none); ``owner_of(fqn)``: whether
        this pipeline rank counts a parameter held on several (tied) in the gradient norm;
        ``tp_sharded``: the parameters each tp rank holds a block of (parallel/tensor.py; the
        others are alike on every tp rank: the gradient norm counts them once)."""
        self.tp_sharded = tp_sharded
        self._tp_flat: dict = {}  # a flat ZeRO shard's key -> its elements' weights in the gradient norm (_tp_weight)
        assert grad_reduce in ("bucketed", "naive") and zero in (0, 1, 2, 3), (grad_reduce, zero)  # api/Plan check
        self.mesh, self.model, self.params, self.timeout, self.grad_reduce = mesh, model, params, timeout, grad_reduce
        self.precision = precision
        self.reduce_dtype = precision.reduce_dtype if precision is not None else torch.float32
        replicas = mesh.replicas if mesh is not None else 1
        self.zero = zero if replicas > 1 else 0
        trained = {f for names in stage_params.values() for f in names}
        self.trained = [f for f in params if f in trained]  # model order
        self.experts = [f for f in self.trained if f in expert_params]
        plain = [f for f in self.trained if f not in expert_params]
        # the expert-data-parallel group: the ranks holding this rank's experts (mesh.expert_group;
        # folded over tp, runtime/mesh.py), over which expert shards are ZeRO-sharded like the
        # rest over the replicas; of one rank (ep == dp*cp, or dp*cp*tp folded), or under ZeRO-0,
        # they stay whole
        self.expert_replicas, self.expert_replica = (mesh.expert_replicas, mesh.expert_replica) if mesh else (1, 0)
        self.expert_rows = {f: params[f].shape[0] for f in self.experts}  # dim 0 of the shard this rank holds
        sharded_experts = set(self.experts) if self.zero >= 1 and self.expert_replicas > 1 else set()
        self.zeroed = [f for f in self.trained if f not in expert_params or f in sharded_experts]  # ZeRO-sharded
        self.whole_experts = [f for f in self.experts if f not in sharded_experts]  # stepped whole
        self.owns = owner_of or (lambda fqn: True)
        # the user's parameter-group option sets, and which one each parameter is in
        options = options or {}
        self.option_sets: list[dict] = [{}]
        self.option_of: dict[str, int] = {}
        for f in self.trained:
            opts = options.get(f, {})
            if opts not in self.option_sets:
                self.option_sets.append(opts)
            self.option_of[f] = self.option_sets.index(opts)
        compute = {f: self._compute_dtype(params[f]) for f in self.trained}
        self.layout = self.storage = None
        self.masters: dict[str, torch.nn.Parameter] = {}
        self.grads = ParamGrads(params)
        # every trained parameter whole on this rank (ZeRO-3: those it steps whole): meta ones get values
        whole_here = self.trained if self.zero != 3 else self.whole_experts
        self._materialize([f for f in whole_here if params[f].is_meta], values)
        if self.zero >= 2:
            specs = [ParamSpec(f, tuple(params[f].shape)) for f in self.zeroed]
            self.layout = zero_layout(specs, self.zero, replicas, tied=set(mesh.tied_groups), option_of=self.option_of,
                                      experts=sharded_experts, expert_replicas=self.expert_replicas,
                                      aligned={k for k, o in enumerate(self.option_sets) if whole_matrices(o)})
            kept = set(self.zeroed)
            streamed = {f for g in self.layout.groups if g.streamed for f in g.fqns}

            def group_values(fqns):
                live = {f: params[f].detach() for f in fqns if not params[f].is_meta}
                return {**live, **(values([f for f in fqns if f not in live]) if len(live) < len(fqns) else {})}

            self.storage = ShardedParameters(
                params, self.layout, {s: [f for f in names if f in kept] for s, names in stage_params.items()},
                mesh.replica_group, mesh.replica, mesh.tied_groups, timeout, values=group_values,
                dtype=compute[self.zeroed[0]] if self.zeroed else None, device=device,
                expert_group=mesh.expert_group, expert_replica=self.expert_replica)
        if self.zero == 3:  # streamed: freed (a meta parameter stays on meta); resident: views of one buffer
            self.sharded = frozenset(streamed)
            with torch.no_grad():
                for f in streamed:
                    if not params[f].is_meta:
                        params[f].data = torch.empty(0, dtype=compute[f], device=params[f].device)
            self._replace(self.storage.resident_views())
            self._cast_to_compute(self.whole_experts)  # stepped whole: fp32 masters, compute copies
        else:
            self._cast_to_compute(self.trained)
        if precision is not None:
            self.sharded = frozenset(self.trained)  # the compute copies are not the whole (fp32) values
        # plain sums: ZeRO-0's gradients over the replicas, whole experts' over their replicas
        sums = [] if mesh is None else [(plain if self.zero == 0 else [], mesh.replica_group, mesh.replicas),
                                        (self.whole_experts, mesh.expert_group, self.expert_replicas)]
        self._sums = [(names, group) for names, group, size in sums if names and size > 1]
        self.reducers = []
        if grad_reduce == "bucketed":
            numel = {f: params[f].numel() for f in self.trained}
            for names, group in self._sums:
                wanted = set(names)
                self.reducers.append(BucketedReducer(
                    self.grads, numel, {s: [f for f in fqns if f in wanted] for s, fqns in stage_params.items()},
                    group, bucket_bytes, deferred=set(mesh.tied_groups), comm=comm, dtype=self.reduce_dtype))
        self.optimizer = None

    def _compute_dtype(self, p: torch.Tensor) -> torch.dtype:
        if self.precision is not None and p.is_floating_point():
            return self.precision.param_dtype
        return p.dtype

    def _materialize(self, fqns: list[str], values) -> None:
        """Real values for meta parameters, one layer group at a time (bounded transient memory)."""
        by_group: dict[str, list[str]] = {}
        for f in fqns:
            by_group.setdefault(layer_group(f), []).append(f)
        for names in by_group.values():
            self._replace(values(names))

    def _replace(self, values: dict[str, torch.Tensor]) -> None:
        """New Parameters (tensors) for these FQNs, in the model and in ``params``."""
        if not values:
            return
        assign(self.model, values)
        named = dict(self.model.named_parameters(remove_duplicate=False))
        for f in values:
            self.params[f] = named[f]

    def _cast_to_compute(self, fqns: list[str]) -> None:
        """Mixed precision: fp32 masters kept (ZeRO-0, and expert shards stepped whole beside the
        ZeRO shards: the fp32 parameters themselves; ZeRO-1/2/3 shards have their own), compute
        copies of ``param_dtype`` put in their place; gradients accumulate in fp32 (the
        masters' ``.grad``, ZeRO-1's buffers, ZeRO-2/3's flat group buffers)."""
        if self.precision is None:
            return
        whole = set(self.whole_experts)
        self.masters = {f: self.params[f] for f in fqns if self.zero == 0 or f in whole}
        if self.zero == 1:  # the ZeRO-1 shards start from fp32
            self._initial = {f: self.params[f].detach() for f in fqns if f not in whole}
        self.grads = _Buffers(self.params, self.masters)
        self._replace({f: self.params[f].detach().to(self._compute_dtype(self.params[f])) for f in fqns})

    # -- graph --------------------------------------------------------------------------------

    def rewrite_programs(self, programs: dict) -> dict:
        if self.zero != 3:
            return programs
        return {s: stream_parameters(p, self.layout, self.storage) for s, p in programs.items()}

    # -- the step (called by the executor) ----------------------------------------------------

    @property
    def grad_sink(self):
        """``sink(fqn, grad) -> bool`` for the W/B programs' fresh gradients (ZeRO-2/3), or None
        (gradients accumulate into ``grads``)."""
        return self.storage.accumulate if self.storage is not None else None

    def sums_tied(self, fqn: str) -> bool:
        """Whether this owner sums a tied parameter's gradient over its pipeline holders itself
        (inside its flat buffer), so the executor must not."""
        return self.storage is not None and fqn in self.storage.group_of

    def zero_grads(self) -> None:
        """Before a step: no gradient yet."""
        self.grads.zero()
        if self.grads.tensors is not self.params:
            ParamGrads(self.params).zero()

    def begin_step(self) -> None:
        for reducer in self.reducers:
            reducer.reset()
        if self.storage is not None:
            self.storage.begin_step()

    def stage_done(self, stage: int) -> None:
        for reducer in self.reducers:
            reducer.stage_done(stage)
        if self.storage is not None:
            self.storage.stage_done(stage)

    def finish(self) -> None:
        """After the pipeline and the tied-parameter sums: every gradient summed (ZeRO-1/2/3:
        reduce-scattered into the master shards' ``.grad``)."""
        if self.storage is not None:
            self.storage.finish()
        if self.zero == 1 and self.optimizer is not None:
            self.optimizer.reduce()
        if self.grad_reduce == "bucketed":
            for reducer in self.reducers:
                reducer.finish(self.timeout)
        else:
            for names, group in self._sums:
                naive_all_reduce(self.grads, names, group, self.reduce_dtype)

    # -- optimizer ----------------------------------------------------------------------------

    def _param_groups(self, fqns: list[str], tensor) -> list[dict]:
        """Parameter groups of ``fqns`` (``tensor(fqn)``: what the optimizer steps), one per
        option set, in the order the sets first appear."""
        groups = [{"params": [tensor(f) for f in fqns if self.option_of[f] == k], **opts}
                  for k, opts in enumerate(self.option_sets)]
        return [g for g in groups if g["params"]]

    def make_optimizer(self, factory):
        """The user's optimizer over what this rank trains, sharded per the ZeRO level (expert
        shards over the expert-data-parallel group, or stepped whole beside the shards when
        that group is one rank), one parameter group per option set (and per group sharded
        over); a ``torch.optim.Optimizer`` at every level (runtime/optim.py)."""
        factory = _accepting_no_parameters(factory, self.option_sets[0])
        experts = self._param_groups(self.whole_experts, lambda f: self.masters.get(f, self.params[f]))
        plain = [f for f in self.trained if f not in set(self.experts)]
        # mixed precision: the masters stepped whole (ZeRO-0: all; else the whole expert shards),
        # cast into their compute copies after each step
        casts = {f: (m, self.params[f]) for f, m in self.masters.items()}
        if self.zero == 0 and self.masters:
            inner = factory(self._param_groups(plain, self.masters.__getitem__) + experts)
            self.optimizer = WrappedOptimizer(inner, casts)  # the masters, cast after each step
        elif self.zero == 0:
            self.optimizer = factory(self._param_groups(self.trained, self.params.__getitem__))
        elif self.zero == 1:
            # one flat set per option set; a parameter held on several pipeline ranks alone, so
            # the gradient norm can count it on one of them
            tied = [f for f in plain if f in self.mesh.tied_groups]
            sets = [([f for f in plain if self.option_of[f] == k and f not in tied], opts)
                    for k, opts in enumerate(self.option_sets)]
            sets = [s for s in sets if s[0]] + [([f], self.option_sets[self.option_of[f]]) for f in tied]
            # expert shards: flat sets of their own over the expert-data-parallel group
            domain = (self.mesh.expert_group, self.expert_replicas, self.expert_replica)
            sharded = [f for f in self.experts if f not in set(self.whole_experts)]
            expert_sets = [([f for f in sharded if self.option_of[f] == k], opts, domain)
                           for k, opts in enumerate(self.option_sets)]
            sets += [s for s in expert_sets if s[0]]
            self.optimizer = ZeroOneOptimizer(sets, self.params, self.grads, factory, self.mesh.replica_group,
                                              self.mesh.replicas, self.mesh.replica, others=experts,
                                              initial=getattr(self, "_initial", None), reduce_dtype=self.reduce_dtype,
                                              casts=casts)
            self.__dict__.pop("_initial", None)  # the fp32 whole values are in the shards now
        else:
            self.optimizer = ShardedOptimizer(self.storage, factory, self.option_sets, experts, casts=casts)
        return self.optimizer

    # -- gradient clipping --------------------------------------------------------------------

    def clip_grad_norm(self, max_norm: float | None) -> torch.Tensor:
        """The global L2 norm of the step's gradients, every trained parameter counted once
        (summed over pipeline ranks, ZeRO shards and expert shards; replicas hold copies: counted
        on one, a whole expert shard on one of its expert-data-parallel group, a ZeRO-sharded one
        on each of its disjoint pieces; a tied parameter on its owner pipeline rank), computed
        after the reduction; with ``max_norm`` every gradient the optimizer reads is scaled as
        ``torch.nn.utils.clip_grad_norm_`` would (by ``max_norm / (norm + 1e-6)`` if below 1)."""
        mesh = self.mesh
        first = mesh is None or mesh.replica == 0          # replicated gradients: count them once
        first_expert = self.expert_replica == 0
        parts, scaled = [], []                              # (tensor, counted here?, weight of its squares)
        plain = [f for f in self.trained if f not in set(self.experts)]
        if self.storage is not None:
            parts += [(g.master.grad, g.tied is None or self.owns(g.tied),
                       self._tp_weight(("group", g.name), g.master.grad, g.fqns, g.offsets, g.shapes,
                                       g.replica * (g.padded // g.replicas)))
                      for g in self.storage.groups]
        elif self.zero == 1 and self.optimizer is not None:
            parts += [(s.master.grad, len(s.names) != 1 or s.names[0] not in mesh.tied_groups or self.owns(s.names[0]),
                       self._tp_weight(("set", k), s.master.grad, s.names, s.offsets, s.shapes, s.lo))
                      for k, s in enumerate(self.optimizer.sets)]
        else:
            parts += [(self.grads.accumulator(f), first and self.owns(f), self._tp_weight(f)) for f in plain]
        parts += [(self.grads.accumulator(f), first_expert, self._tp_weight(f)) for f in self.whole_experts]
        parts = [p for p in parts if p[0] is not None]
        device = parts[0][0].device if parts else torch.device("cpu")
        total = torch.zeros((), dtype=torch.float32, device=device)
        for g, counted, w in parts:
            if counted:
                sq = g.detach().float().pow(2)
                total += sq.sum() if isinstance(w, float) and w == 1.0 else (sq * w).sum()
            scaled.append(g)
        if mesh is not None:
            comms.all_reduce_sum(total)  # every rank of the world: pipeline, replicas, experts
        norm = total.sqrt()
        if max_norm is not None:
            coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
            for g in scaled:
                g.mul_(coef.to(g.dtype))
        return norm

    def _tp_weight(self, key, flat=None, fqns=(), offsets=(), shapes=(), lo: int = 0):
        """The weight of a gradient's squares in the norm under tensor parallelism: 1 for a tp
        shard's elements (each tp rank holds another block), 1/tp for a parameter alike on every
        tp rank (the world-wide sum then counts it once); 1.0 without tp. ``key`` an FQN, or a
        flat ZeRO shard's name for ``flat`` (its gradient; its parameters, their offsets and
        shapes, where the shard starts): one weight per element, built on first use and kept."""
        tp = self.mesh.tp if self.mesh is not None else 1
        if tp == 1 or flat is None:
            return 1.0 if tp == 1 or key in self.tp_sharded else 1.0 / tp
        w = self._tp_flat.get(key)
        if w is None:
            n = flat.numel()
            w = torch.full((n,), 1.0 / tp, dtype=torch.float32, device=flat.device)
            for f, o, shape in zip(fqns, offsets, shapes):
                if f in self.tp_sharded:
                    a, b = max(o, lo), min(o + math.prod(shape), lo + n)
                    if a < b:
                        w[a - lo: b - lo] = 1.0
            self._tp_flat[key] = w
        return w

    # -- state --------------------------------------------------------------------------------

    def whole(self) -> dict:
        """Whole values of ``sharded`` (collective): ZeRO-3's gathered groups (an expert shard
        gathered over its expert-data-parallel group, then over the EP group into the whole
        tensor); under mixed precision the fp32 masters of every trained parameter."""
        if self.precision is None:
            if self.zero != 3:
                return {}
            return self._expert_wholes({f: v for f, v in self.storage.whole().items() if f in self.sharded})
        if self.zero == 0:
            out = {f: m.detach().clone() for f, m in self.masters.items()}
        elif self.zero == 1:
            out = self.optimizer.whole() if self.optimizer is not None else {}
        else:
            out = self.storage.whole(torch.float32)
        out.update({f: self.masters[f].detach().clone() for f in self.whole_experts if f not in out})
        return self._expert_wholes(out)

    def _expert_wholes(self, values: dict) -> dict:
        """``values`` with each expert shard (this rank's rows) replaced by the whole tensor: the
        EP group's shards concatenated along dim 0 in EP rank order (parallel/expert.py)."""
        return {f: comms.all_gather_dim0(v.contiguous(), self.mesh.ep_group) if f in self.expert_rows else v
                for f, v in values.items()}

    def _expert_locals(self, values: dict) -> dict:
        """``values`` (whole tensors) with each expert parameter cut to the rows this rank holds."""
        mesh = self.mesh
        return {f: v.narrow(0, mesh.ep_rank * self.expert_rows[f], self.expert_rows[f]) if f in self.expert_rows
                else v for f, v in values.items()}

    def load_whole(self, values: dict) -> None:
        """After the whole parameters were written (ZeRO-0..2 hold them; ExpertParallel wrote
        the expert shards it holds whole): refresh the masters and shards."""
        values = self._expert_locals({f: values[f] for f in self.trained if f in values})
        if self.storage is not None:
            self.storage.load({f: values[f] if f in values else self.params[f].detach()
                               for f in self.storage.group_of})
        elif self.zero == 1 and self.optimizer is not None:
            self.optimizer.reload(values)
        if self.precision is not None:
            with torch.no_grad():
                for f in self.trained:
                    if f in values:
                        if f in self.masters:
                            self.masters[f].copy_(values[f])
                        if not self.params[f].is_meta and self.params[f].numel():
                            self.params[f].copy_(values[f])

    # -- checkpoints (autopar/checkpoint.py) ---------------------------------------------------

    def local_shards(self) -> dict[str, list[Shard]]:
        """FQN -> where this process holds each trained parameter's value as the optimizer steps
        it, in the coordinates of the parameter as this process holds it (an expert shard's own
        rows; ExpertParallel places them in the whole): the ZeRO-2/3 group shard or the ZeRO-1
        flat-set shard (one contiguous range of the flat vector: a piece of each parameter it
        overlaps, padding in none; an expert shard's over its expert-data-parallel group), else
        the fp32 master (mixed precision) or the parameter itself, held whole by every replica
        (an expert shard stepped whole by the replicas with the same experts). Their
        per-element optimizer state has the layout of ``Shard.source``."""
        mesh = self.mesh
        replicas, replica = (mesh.replicas, mesh.replica) if mesh is not None else (1, 0)
        out: dict[str, list[Shard]] = {}

        def flat_shard(fqns, shapes, offsets, master, lo: int, n: int) -> None:
            """Elements [lo, lo + n) of a flat vector holding ``fqns`` at ``offsets``; a shard of
            padding only is an empty piece of the first (its optimizer state has a name then)."""
            found = False
            for f, shape, o in zip(fqns, shapes, offsets):
                size = math.prod(shape)
                a, b = max(lo, o), min(lo + n, o + size)
                if a < b:
                    out[f] = [Shard(a - o, b - o, tuple(shape), master, start=a - lo)]
                    found = True
            if fqns and not found:
                out[fqns[0]] = [Shard(0, 0, tuple(shapes[0]), master)]

        experts = set(self.experts)
        if self.storage is not None:
            for g in self.storage.groups:
                n = g.padded // g.replicas
                flat_shard(g.fqns, g.shapes, g.offsets, g.master, g.replica * n, n)
        elif self.zero == 1 and self.optimizer is not None:
            for s in self.optimizer.sets:
                flat_shard(s.names, s.shapes, s.offsets, s.master, s.lo, s.shard)
        else:
            for f in self.trained:
                if f not in experts:
                    src = self.masters.get(f, self.params[f])
                    out[f] = [Shard(0, src.numel(), tuple(src.shape), src, copies=replicas, copy=replica)]
        for f in self.whole_experts:
            src = self.masters.get(f, self.params[f])
            out[f] = [Shard(0, src.numel(), tuple(src.shape), src, copies=self.expert_replicas,
                            copy=self.expert_replica)]
        return out

    def loaded(self) -> None:
        """After a checkpoint was read in place into the masters, the shards and every whole
        copy the programs read: ZeRO-3's gather buffers no longer hold current values."""
        if self.storage is not None:
            self.storage.holds = [None, None]


def _accepting_no_parameters(factory, options: dict):
    """``factory`` that builds the optimizer of a rank that trains nothing too: torch's optimizers
    refuse an empty parameter list, but a pipeline rank may hold only frozen parameters, or only
    parameters that get no gradient (used inside a ``no_grad`` region alone). That rank gets one
    empty group with the first option set's options, so ``pm.optimizer``, its learning rate and
    a scheduler on it work as on every other rank, and its step changes nothing."""
    def build(groups):
        groups = list(groups)
        return factory(groups if any(g["params"] for g in groups) else [{"params": [], **options}])
    return build

