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
  shards are summed over the replicas that hold the same experts (``mesh.expert_group``),
  never ZeRO-sharded, and stepped whole beside the shards;
* the masters the optimizer steps: the parameters themselves (fp32 training, ZeRO-0), fp32
  copies (mixed precision, ZeRO-0), the ZeRO-1 flat shard, the ZeRO-2/3 group shards; and the
  compute copies the programs read (``param_dtype`` under mixed precision), refreshed from the
  masters after every step;
* the ZeRO-2/3 layout (parallel/zero_layout.py) and its storage, and ZeRO-3's program rewrite
  (passes/zero_stream.py);
* the user's optimizer, wrapped for the ZeRO level;
* the mapping between its masters and whole parameters (``whole`` / ``load_whole``).

In local mode (no mesh) there is one replica: no reduction, ZeRO off, mixed precision as
above. The loss tangent already carries 1/(dp*m*cp): every reduction is a plain sum.
"""
from __future__ import annotations

import torch

from autopar.passes.zero_stream import stream_parameters
from autopar.runtime.grad_reduce import BucketedReducer, naive_all_reduce
from autopar.runtime.materialize import assign
from autopar.runtime.sharded import ShardedOptimizer, ShardedParameters
from autopar.runtime.stage_work import ParamGrads
from autopar.runtime.zero import ZeroOneOptimizer

from .base import Parallelism
from .zero_layout import ParamSpec, layer_group, zero_layout


class _Buffers(ParamGrads):
    """fp32 gradient buffers not attached to a parameter (mixed precision under ZeRO-1)."""

    def __init__(self, like: dict[str, torch.Tensor]):
        super().__init__({})
        self.like, self.buffers = like, {}

    def accumulator(self, fqn: str) -> torch.Tensor:
        g = self.buffers.get(fqn)
        if g is None:
            p = self.like[fqn]
            g = self.buffers[fqn] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
        return g

    def add(self, fqn: str, g: torch.Tensor) -> None:
        self.accumulator(fqn).add_(g)

    def zero(self) -> None:
        self.buffers = {}


class MastersOptimizer:
    """The user's optimizer over fp32 masters; after each step the masters are cast into the
    compute copies the programs read (mixed precision without ZeRO)."""

    def __init__(self, factory, masters: dict[str, torch.nn.Parameter], compute: dict[str, torch.nn.Parameter],
                 others: list[torch.nn.Parameter] = ()):
        self.masters, self.compute = masters, compute
        self.optimizer = factory(list(masters.values()) + list(others))

    def step(self) -> None:
        self.optimizer.step()
        with torch.no_grad():
            for f, m in self.masters.items():
                self.compute[f].copy_(m)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        return self.optimizer.state_dict()


class DataParallel(Parallelism):
    name = "dp"

    def __init__(self, *, zero: int, mesh, model, params: dict[str, torch.nn.Parameter], stage_params: dict[int, tuple],
                 expert_params: frozenset[str] = frozenset(), grad_reduce: str = "bucketed",
                 bucket_bytes: int = 25 * 2**20, timeout=None, comm=None, precision=None, values=None,
                 device: torch.device | None = None):
        """``params``: canonical FQN -> Parameter (model order; the held ones real, the dict is
        kept current as compute copies replace them); ``stage_params``: this process's stage
        index -> the FQNs its programs compute gradients of; ``precision``: an
        ``autopar.MixedPrecision`` or None; ``values(fqns)``: whole values of parameters that are
        not materialized (ZeRO-3 streamed groups of a meta model)."""
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
        compute = {f: self._compute_dtype(params[f]) for f in self.trained}
        self.layout = self.storage = None
        self.masters: dict[str, torch.nn.Parameter] = {}
        self.grads = ParamGrads(params)
        if self.zero != 3:  # every trained parameter whole on this rank: give the meta ones values
            self._materialize([f for f in self.trained if params[f].is_meta], values)
        if self.zero >= 2:
            specs = [ParamSpec(f, tuple(params[f].shape)) for f in plain]
            self.layout = zero_layout(specs, self.zero, replicas, tied=set(mesh.tied_groups))
            kept = set(plain)
            streamed = {f for g in self.layout.groups if g.streamed for f in g.fqns}

            def group_values(fqns):
                live = {f: params[f].detach() for f in fqns if not params[f].is_meta}
                return {**live, **(values([f for f in fqns if f not in live]) if len(live) < len(fqns) else {})}

            self.storage = ShardedParameters(
                params, self.layout, {s: [f for f in names if f in kept] for s, names in stage_params.items()},
                mesh.replica_group, mesh.replica, mesh.tied_groups, timeout, values=group_values,
                dtype=compute[plain[0]] if plain else None, device=device)
        if self.zero == 3:  # streamed: freed (a meta parameter stays on meta); resident: views of one buffer
            self.sharded = frozenset(streamed)
            with torch.no_grad():
                for f in streamed:
                    if not params[f].is_meta:
                        params[f].data = torch.empty(0, dtype=compute[f], device=params[f].device)
            self._replace(self.storage.resident_views())
        else:
            self._cast_to_compute(self.trained)
        if precision is not None:
            self.sharded = frozenset(self.trained)  # the compute copies are not the whole (fp32) values
        # plain sums: ZeRO-0's gradients over the replicas, the experts' over their replicas
        sums = [] if mesh is None else [(plain if self.zero == 0 else [], mesh.replica_group, mesh.replicas),
                                        (self.experts, mesh.expert_group, mesh.replicas // mesh.ep)]
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
        """Mixed precision: fp32 masters kept (ZeRO-0: the parameters themselves; ZeRO-1/2 have
        their own shards), compute copies of ``param_dtype`` put in their place."""
        if self.precision is None:
            return
        if self.zero == 0:
            self.masters = {f: self.params[f] for f in fqns}
            self.grads = ParamGrads(self.masters)
        elif self.zero == 1:
            self._initial = {f: self.params[f].detach() for f in fqns}  # the ZeRO-1 shard starts from fp32
            self.grads = _Buffers(self.params)
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
        """After the pipeline and the tied-parameter sums: every gradient summed."""
        if self.storage is not None:
            self.storage.finish()
        if self.grad_reduce == "bucketed":
            for reducer in self.reducers:
                reducer.finish(self.timeout)
        else:
            for names, group in self._sums:
                naive_all_reduce(self.grads, names, group, self.reduce_dtype)

    # -- optimizer ----------------------------------------------------------------------------

    def make_optimizer(self, factory):
        """The user's optimizer over what this rank trains, sharded per the ZeRO level
        (expert-parallel shards are stepped whole beside the ZeRO shards)."""
        experts = [self.masters.get(f, self.params[f]) for f in self.experts]
        plain = [f for f in self.trained if f not in set(self.experts)]
        if self.zero == 0 and self.masters:
            self.optimizer = MastersOptimizer(factory, {f: self.masters[f] for f in plain},
                                              {f: self.params[f] for f in plain}, experts)
        elif self.zero == 0:
            self.optimizer = factory([self.params[f] for f in self.trained])
        elif self.zero == 1:
            self.optimizer = ZeroOneOptimizer(plain, self.params, self.grads, factory, self.mesh.replica_group,
                                              self.mesh.replicas, self.mesh.replica, others=experts,
                                              initial=getattr(self, "_initial", None), reduce_dtype=self.reduce_dtype)
            self.__dict__.pop("_initial", None)  # the fp32 whole values are in the shard now
        else:
            self.optimizer = ShardedOptimizer(self.storage, factory, experts)
        return self.optimizer

    # -- state --------------------------------------------------------------------------------

    def whole(self) -> dict:
        """Whole values of ``sharded`` (collective): ZeRO-3's gathered groups; under mixed
        precision the fp32 masters of every trained parameter."""
        if self.precision is None:
            return {f: v for f, v in self.storage.whole().items() if f in self.sharded} if self.zero == 3 else {}
        if self.zero == 0:
            return {f: m.detach().clone() for f, m in self.masters.items()}
        if self.zero == 1:
            out = self.optimizer.whole() if self.optimizer is not None else {}
        else:
            out = self.storage.whole(torch.float32)
        return {**out, **{f: self.params[f].detach().float() for f in self.experts}}

    def load_whole(self, values: dict) -> None:
        """After the whole parameters were written (ZeRO-0..2 hold them): refresh the masters."""
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
