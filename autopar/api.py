"""`autopar.parallelize` and `ParallelModel`: the user-facing layer.

``parallelize`` checks its arguments and hands over to the orchestrator (autopar/build.py),
now when it can capture, else at the first ``step``. ``ParallelModel`` runs steps and maps
state between the model's FQNs and the parallelism owners (autopar/parallel/).
"""
from __future__ import annotations

import os
import time
from datetime import timedelta

import torch
import torch.nn as nn

from autopar import batches, metrics, state
from autopar import build as _build
from autopar.collectives import moe_exchange
from autopar.plan import Plan


def parallelize(model: nn.Module, example_inputs, loss_fn=None, optimizer=None, plan: Plan | None = None, *,
                example_target=None, weights=None, mixed_precision=None, seed: int = 0, init_fn=None,
                param_groups=None, max_grad_norm: float | None = None, batch: str = "global", log_every: int = 0,
                timeout: float | None = None, generated: bool = True, grad_reduce: str = "bucketed",
                bucket_mb: float = 25.0, local_transfers: bool = False,
                compile: bool | None = None) -> "ParallelModel":
    """Parallelize ``model`` for training (docs/parallelism.md, docs/large-models.md).

    ``example_inputs``: one global batch, as ``step`` will be given it: a tuple of tensors
    (positional arguments of ``forward``) or a dict (keyword arguments, e.g. ``input_ids``,
    ``attention_mask``, ``labels``); every tensor is sliced along dim 0.
    ``loss_fn(output, target)`` returns a scalar (``output`` as the model returns it, e.g. a
    ``ModelOutput``); None: the model's output is the loss (or its ``.loss``).
    ``optimizer``: a callable taking parameters (or parameter groups), e.g.
    ``functools.partial(torch.optim.AdamW, lr=1e-3)``; ``pm.optimizer`` is then a
    ``torch.optim.Optimizer`` under every ZeRO level. ``param_groups``: per-parameter options,
    ``(fqn, p) -> dict`` or ``[{"params": [fqn, ...], **options}, ...]``.
    ``plan``: an ``autopar.Plan``; None: rank 0 asks the planner for this world (pp, dp, cp
    where the context-parallel pass accepts the model, ep for recognized MoE blocks, ZeRO,
    schedules) and every rank takes its choice. ``example_target``: capture now (else at the
    first ``step``: a loss_fn needs a target to be traced).
    ``model`` may be on the meta device: each process materializes only what its plan holds,
    from ``weights`` (a safetensors file, an HF-style directory, a ``torch.save``d or in-memory
    state dict, by FQN, each process reading its tensors only) or from the model's init
    (``init_fn(model)``, ``model.init_weights()``, else ``reset_parameters()``) with one
    generator per tensor from ``seed``: ``autopar.init_weights(model, seed)`` reproduces it.
    ``mixed_precision``: an ``autopar.MixedPrecision`` (design.md §5).
    ``max_grad_norm``: clip the global gradient norm as ``clip_grad_norm_`` would.
    ``batch``: "global" (every process passes the global batch) or "local" (its dp replica's;
    autopar/batches.py). ``log_every``: a metrics line per N steps on rank 0 (autopar/metrics.py).
    ``timeout``: seconds a rank waits for a peer before reporting where every rank was
    (default $AUTOPAR_TIMEOUT or 300). ``generated=False``: interpret the action lists instead
    of the generated steps. ``grad_reduce``: "bucketed" (``bucket_mb`` MiB buckets overlapping
    the step) or "naive" (the oracle). ``local_transfers`` (local mode): values crossing
    pipeline ranks are copied on the communication stream, as P2P would move them.
    ``compile``: True runs every stage program compiled by Inductor (``Plan.compile``, given
    plan or the planner's), False op by op; None (the default): as the plan says.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"autopar.parallelize: model must be an nn.Module, got {type(model).__name__}")
    if grad_reduce not in ("bucketed", "naive"):
        raise ValueError(f"autopar: grad_reduce must be 'bucketed' or 'naive', got {grad_reduce!r}")
    example_inputs, names = batches.as_inputs(example_inputs)
    if plan is not None:
        _build.check_world(plan)
    if batch not in ("global", "local"):
        raise ValueError(f"autopar: batch must be 'global' or 'local', got {batch!r}")
    if batch == "local" and (plan is None or (not _build.distributed() and plan.dp > 1)):
        raise ValueError("autopar: batch='local' needs a Plan (the global batch is dp times the local one) and "
                         "one process per dp replica; pass plan=, or batch='global'")
    seconds = float(timeout if timeout is not None else os.environ.get("AUTOPAR_TIMEOUT", "300"))
    pm = ParallelModel(model, loss_fn, plan, optimizer=optimizer, max_grad_norm=max_grad_norm, batch=batch,
                       log_every=log_every, options=dict(
        weights=weights, mixed_precision=mixed_precision, seed=seed, init_fn=init_fn, param_groups=param_groups,
        local_replicas=plan.dp if batch == "local" else 1, input_names=names,
        timeout=timedelta(seconds=seconds), generated=generated, grad_reduce=grad_reduce,
        bucket_bytes=int(bucket_mb * 2**20), local_transfers=local_transfers, compile=compile))
    if loss_fn is None or example_target is not None:
        pm.prepare(tuple(example_inputs), example_target)
    return pm


class ParallelModel:
    """A model split into pipeline stages with F/I/W programs, trained by ``step``."""

    def __init__(self, model: nn.Module, loss_fn, plan: Plan | None, *, optimizer=None, options: dict,
                 max_grad_norm: float | None = None, batch: str = "global", log_every: int = 0):
        self.model = model
        self.loss_fn = loss_fn
        self.plan = plan                      # as resolved once built (microbatch count filled in)
        self.planner_summary: str | None = None  # what the planner chose and predicted (plan=None)
        self.timeout = options["timeout"]
        self.max_grad_norm, self.batch, self.log_every = max_grad_norm, batch, log_every
        self.track_grad_norm = False          # compute the norm (pm.metrics) without clipping
        self.step_count = 0                   # optimizer steps taken (a checkpoint keeps it)
        self.metrics: dict = {}               # of the last step (autopar/metrics.py)
        self._optimizer_factory = optimizer
        self._options = options
        self._built: _build.Built | None = None
        self._recorder = metrics.Recorder()

    @property
    def optimizer(self):
        """The ``torch.optim.Optimizer`` this process steps (None without an optimizer factory)."""
        return self._require_built("the optimizer").optimizer

    @property
    def data_parallel_rank(self) -> int:
        """This process's dp replica (for a DistributedSampler with batch="local")."""
        b = self._require_built("data_parallel_rank")
        return b.mesh.dp_rank if b.mesh is not None else 0

    @property
    def data_parallel_size(self) -> int:
        return self.plan.dp

    def prepare(self, inputs: tuple, target=None) -> _build.Built:
        """Capture and build now, for this batch (``step`` does it at its first call)."""
        if self._built is None:
            b = self._built = _build.build(self.model, inputs, target, self.loss_fn, self.plan,
                                           optimizer=self._optimizer_factory, **self._options)
            self.plan = b.plan
            self.planner_summary = (b.prediction or {}).get("summary") or self.planner_summary
            self._recorder.setup(b)
            if self.log_every:
                metrics.install_rank_logging(b.mesh.rank if b.mesh is not None else 0)
        return self._built

    def _run(self, inputs, target, train: bool):
        inputs, names = batches.as_inputs(inputs, self._options["input_names"])
        if self.loss_fn is not None and target is None and (self.batch == "global" or self._built is None):
            raise ValueError("autopar: step needs a target when a loss_fn was given")
        b = self.prepare(inputs, target)
        plan = b.plan
        inputs, names = batches.with_shift_labels(inputs, names, self.model, self.loss_fn, plan.cp)
        n_total = plan.dp * b.num_microbatches * plan.cp  # a cp rank's local mean loss weighs 1/cp
        if train:
            b.parallelisms["dp"].zero_grads()
        total = None
        local = self.batch == "local"
        shifted = not getattr(getattr(self.model, "config", None), "is_encoder_decoder", False)
        replicas = list(batches.microbatches(b, inputs, target, local=local))  # checks every tensor first
        scales = batches.label_scales(b, inputs, names, self.loss_fn, local, shifted, target)
        with moe_exchange.model_step(b.moe_entries, backward=train):  # its MoE experts' states and statistics
            for r, mbs in enumerate(replicas):
                loss = b.executor.run(mbs, scales[r] if scales is not None else 1.0 / n_total, train=train)
                total = loss if total is None else total + loss
        return b, inputs, total

    # -- training ---------------------------------------------------------------------------

    def step(self, inputs, target=None) -> torch.Tensor:
        """One optimizer step over the global batch; returns the loss (design.md §5)."""
        t0 = time.perf_counter()
        b, inputs, total = self._run(inputs, target, train=True)
        norm = None
        if self.max_grad_norm is not None or self.track_grad_norm:
            norm = b.parallelisms["dp"].clip_grad_norm(self.max_grad_norm)
        if b.optimizer is not None:
            b.optimizer.step()
        self.step_count += 1
        elapsed = time.perf_counter() - t0
        self.metrics = self._recorder.record(b, inputs, total, norm, elapsed, self.step_count, self.log_every)
        return total

    @torch.no_grad()
    def evaluate(self, inputs, target=None) -> torch.Tensor:
        """The loss of a forward-only pass over the batch (no gradient, no update, no buffer
        change), equal to eager ``torch.no_grad()``; the batch is cut as ``step`` cuts it."""
        return self._run(inputs, target, train=False)[2]

    # -- state ------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """Full tensors under the original FQNs (tied parameters under every name), on every
        rank: each from the pipeline rank that holds it, shards gathered, fp32 masters under
        mixed precision (autopar/state.py)."""
        if self._built is None:
            return self.model.state_dict()
        return state.whole_state(self._built, self.model)

    def load_state_dict(self, state_dict, strict: bool = True):
        """Load whole tensors by FQN: every rank writes what it holds, each owner its shards."""
        if self._built is None:
            return self.model.load_state_dict(state_dict, strict=strict)
        return state.load_whole_state(self._built, self.model, state_dict, strict)

    def save(self, path: str) -> None:
        """Write a checkpoint to directory ``path`` with torch.distributed.checkpoint: collective,
        every rank writes only what it owns (autopar/checkpoint.py)."""
        from autopar import checkpoint

        checkpoint.save(self, path)

    def load(self, path: str) -> None:
        """Read a checkpoint written by ``save`` under any plan (collective; resharded)."""
        from autopar import checkpoint

        checkpoint.load(self, path)

    # -- inspection -------------------------------------------------------------------------

    @property
    def built(self) -> _build.Built:
        """Everything the build made (capture, stages, programs as run, executor, owners)."""
        return self._require_built("built")

    @property
    def stages(self):
        return self._require_built("stages").stages

    @property
    def programs(self):
        """Every stage's programs as this process runs them (other ranks' stages: StageInfo)."""
        return self._require_built("programs").programs

    @property
    def schedule(self):
        return self._require_built("schedule").schedule

    @property
    def executed_actions(self) -> list[list[str]] | list[str]:
        """The compute actions of the last step in the order they ran: per rank in local mode,
        this rank's list in distributed mode."""
        return self._require_built("executed_actions").executor.executed

    def stage_table(self) -> str:
        from autopar.inspect import stage_table

        b = self._require_built("stage_table")
        opt = b.optimizer
        off = b.executor.work.offload
        return stage_table(b.programs, b.schedule, routes=getattr(getattr(opt, "inner", opt), "routes", None),
                           offloaded=off.stage_bytes if off is not None else None)

    def dump(self, directory: str) -> list[str]:
        """Write every stage's F, I, W, B code as Python, each rank's step and a stage table;
        returns the paths."""
        from autopar.inspect import dump_programs, dump_steps

        b = self._require_built("dump")
        os.makedirs(directory, exist_ok=True)
        return dump_programs(b.programs, b.schedule, b.plan, directory) + dump_steps(b.schedule, directory)

    def _require_built(self, what: str) -> _build.Built:
        if self._built is None:
            raise RuntimeError(f"autopar: {what} needs the captured program; pass example_target= to parallelize "
                               "or run one step first")
        return self._built
