"""Data parallelism and ZeRO 0-3 over the dp*cp replicas of each pipeline rank: one owner.

``DataParallel`` holds, for the parameters this process trains:

* the gradient reduction the executor drives (``begin_step``, ``stage_done`` after a stage's
  last W/B of the step, ``finish`` after the pipeline): ZeRO-0 sums every gradient over the
  replicas (bucketed and overlapped, runtime/grad_reduce.py, or the naive oracle); ZeRO-1
  leaves it to its optimizer (reduce-scatter, step the shard, all-gather: runtime/zero.py);
  ZeRO-2/3 add each fresh gradient into its layer group's flat buffer (``grad_sink``) and
  reduce-scatter a group once its last W ran (runtime/sharded.py). Expert-parallel shards are
  summed over the replicas that hold the same experts instead (``mesh.expert_group``), never
  ZeRO-sharded, and stepped whole beside the shards;
* the ZeRO-2/3 layout (parallel/zero_layout.py) and its storage, and ZeRO-3's program rewrite
  (passes/zero_stream.py);
* the user's optimizer, wrapped for the ZeRO level;
* the mapping between its shards and whole parameters (``whole`` / ``load_whole``).

The loss tangent already carries 1/(dp*m*cp): every reduction is a plain sum.
"""
from __future__ import annotations

import torch

from autopar.passes.zero_stream import stream_parameters
from autopar.runtime.grad_reduce import BucketedReducer, naive_all_reduce
from autopar.runtime.sharded import ShardedOptimizer, ShardedParameters
from autopar.runtime.zero import ZeroOneOptimizer

from .base import Parallelism
from .zero_layout import ParamSpec, zero_layout


class DataParallel(Parallelism):
    name = "dp"

    def __init__(self, *, zero: int, mesh, params: dict[str, torch.nn.Parameter], stage_params: dict[int, tuple],
                 expert_params: frozenset[str] = frozenset(), grad_reduce: str = "bucketed",
                 bucket_bytes: int = 25 * 2**20, timeout=None, comm=None):
        """``stage_params``: this rank's stage index -> the FQNs its programs compute gradients
        of; ``params``: canonical FQN -> Parameter (model order)."""
        assert grad_reduce in ("bucketed", "naive") and zero in (0, 1, 2, 3), (grad_reduce, zero)  # api/Plan check
        self.mesh, self.params, self.timeout, self.grad_reduce = mesh, params, timeout, grad_reduce
        self.zero = zero if mesh.replicas > 1 else 0
        trained = {f for names in stage_params.values() for f in names}
        self.trained = [f for f in params if f in trained]  # model order
        self.experts = [f for f in self.trained if f in expert_params]
        plain = [f for f in self.trained if f not in expert_params]
        self.layout = self.storage = None
        if self.zero >= 2:
            specs = [ParamSpec(f, tuple(params[f].shape)) for f in plain]
            self.layout = zero_layout(specs, self.zero, mesh.replicas, tied=set(mesh.tied_groups))
            kept = set(plain)
            self.storage = ShardedParameters(
                params, self.layout, {s: [f for f in names if f in kept] for s, names in stage_params.items()},
                mesh.replica_group, mesh.replica, mesh.tied_groups, timeout)
        if self.zero == 3:
            self.sharded = frozenset(f for g in self.layout.groups if g.streamed for f in g.fqns)
        # plain sums: ZeRO-0's gradients over the replicas, the experts' over their replicas
        self._sums = [(plain if self.zero == 0 else [], mesh.replica_group, mesh.replicas),
                      (self.experts, mesh.expert_group, mesh.replicas // mesh.ep)]
        self._sums = [(names, group) for names, group, size in self._sums if names and size > 1]
        self.reducers = []
        if grad_reduce == "bucketed":
            for names, group in self._sums:
                wanted = set(names)
                self.reducers.append(BucketedReducer(
                    params, {s: [f for f in fqns if f in wanted] for s, fqns in stage_params.items()},
                    group, bucket_bytes, deferred=set(mesh.tied_groups), comm=comm))
        self.optimizer = None

    # -- graph --------------------------------------------------------------------------------

    def rewrite_programs(self, programs: dict) -> dict:
        if self.zero != 3:
            return programs
        return {s: stream_parameters(p, self.layout, self.storage) for s, p in programs.items()}

    # -- the step (called by the executor) ----------------------------------------------------

    @property
    def grad_sink(self):
        """``sink(fqn, grad) -> bool`` for the W/B programs' fresh gradients (ZeRO-2/3), or None
        (gradients accumulate into ``.grad``)."""
        return self.storage.accumulate if self.storage is not None else None

    def sums_tied(self, fqn: str) -> bool:
        """Whether this owner sums a tied parameter's gradient over its pipeline holders itself
        (inside its flat buffer), so the executor must not."""
        return self.storage is not None and fqn in self.storage.group_of

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
                naive_all_reduce(self.params, names, group)

    # -- optimizer ----------------------------------------------------------------------------

    def make_optimizer(self, factory):
        """The user's optimizer over what this rank trains, sharded per the ZeRO level
        (expert-parallel shards are stepped whole beside the ZeRO shards)."""
        experts = [self.params[f] for f in self.experts]
        if self.zero == 0:
            self.optimizer = factory([self.params[f] for f in self.trained])
        elif self.zero == 1:
            plain = [self.params[f] for f in self.trained if f not in set(self.experts)]
            self.optimizer = ZeroOneOptimizer(plain, factory, self.mesh.replica_group, self.mesh.replicas,
                                              self.mesh.replica, others=experts)
        else:
            self.optimizer = ShardedOptimizer(self.storage, factory, experts)
        return self.optimizer

    # -- state --------------------------------------------------------------------------------

    def whole(self) -> dict:
        if self.zero != 3:
            return {}
        return {f: v for f, v in self.storage.whole().items() if f in self.sharded}

    def load_whole(self, values: dict) -> None:
        """After the whole parameters were written (ZeRO-0..2 hold them): refresh the shards."""
        if self.storage is not None:
            self.storage.load({f: values[f] if f in values else self.params[f].detach()
                               for f in self.storage.group_of})
        elif self.zero == 1 and self.optimizer is not None:
            self.optimizer.reload()

