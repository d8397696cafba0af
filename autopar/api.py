"""`autopar.parallelize` and `ParallelModel`: the user-facing layer.

``parallelize`` checks its arguments and hands over to the orchestrator (autopar/build.py),
now when it can capture, else at the first ``step``. ``ParallelModel`` runs steps and maps
state between the model's FQNs and the parallelism owners (autopar/parallel/).
"""
from __future__ import annotations

import os
from collections import namedtuple
from datetime import timedelta

import torch
import torch.nn as nn

from autopar import build as _build
from autopar.plan import Plan

IncompatibleKeys = namedtuple("IncompatibleKeys", ["missing_keys", "unexpected_keys"])


def parallelize(model: nn.Module, example_inputs, loss_fn=None, optimizer=None, plan: Plan | None = None, *,
                example_target=None, weights=None, mixed_precision=None, seed: int = 0, init_fn=None,
                param_groups=None,
                timeout: float | None = None, generated: bool = True, grad_reduce: str = "bucketed",
                bucket_mb: float = 25.0, local_transfers: bool = False) -> "ParallelModel":
    """Parallelize ``model`` for training.

    ``example_inputs``: a tuple of tensors, one global batch (what ``step`` will be given).
    ``loss_fn(output, target)`` returns a scalar; None means the model's output is the loss.
    ``optimizer``: a callable taking an iterable of parameters, e.g.
    ``functools.partial(torch.optim.AdamW, lr=1e-3)``; None means no parameter update.
    ``plan``: an ``autopar.Plan``; None asks the planner (``autopar.planner``) for the current
    world (the process group's size, or 1 in local mode) on the current device's profile, when
    the graph is captured; rank 0 plans and every rank takes its plan; the choice is logged.
    That search covers pp, dp, ZeRO 0-3, the schedules and, for models built from
    ``autopar.nn.MoE``, ep; context parallelism is set explicitly (``Plan(cp=...)``).
    ``example_target``: a target batch, so the graph is captured now; otherwise capture waits
    for the first ``step`` (a loss_fn needs a target to be traced).
    ``model`` may be built on the meta device (``with torch.device("meta"): model = M(cfg)``,
    example inputs on the real device): each process then materializes only the parameters and
    buffers its plan holds, from ``weights`` (a safetensors file, a Hugging Face-style directory
    with ``model.safetensors.index.json``, a ``torch.save``d state dict, or a state dict; keyed by
    the model's FQNs, each process reading only its tensors), else from the model's own init
    (``init_fn(model)``, ``model.init_weights()`` or the modules' ``reset_parameters()``) run
    with one generator per tensor seeded from ``seed`` and the tensor's FQN, so every plan gets
    the same values as ``autopar.init_weights(model, seed)`` gives eagerly. ``weights`` also
    loads a model that is already materialized.
    ``mixed_precision``: an ``autopar.MixedPrecision`` (compute copies in ``param_dtype``, fp32
    masters, fp32 gradient accumulation, reduction in ``reduce_dtype``; see design.md §5).
    ``timeout``: seconds a rank waits for a peer before reporting where every rank was
    (default: $AUTOPAR_TIMEOUT or 300). ``generated=False`` runs the per-rank action lists with
    the interpreter instead of the generated straight-line programs (same results).
    ``grad_reduce``: "bucketed" (dp gradient sums in ``bucket_mb`` MiB fp32 buckets, started as
    soon as a stage's last W ran, overlapping the rest of the step) or "naive" (one blocking
    all-reduce per parameter at the end; the oracle).
    ``local_transfers`` (local mode): activations and gradients crossing pipeline ranks are
    copied on the communication stream (runtime/streams.py) and waited for by their consumer,
    as P2P would move them; on one GPU this exercises the stream/event ordering (same results).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"autopar.parallelize: model must be an nn.Module, got {type(model).__name__}")
    if grad_reduce not in ("bucketed", "naive"):
        raise ValueError(f"autopar: grad_reduce must be 'bucketed' or 'naive', got {grad_reduce!r}")
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    if plan is not None:
        _build.check_world(plan)
    seconds = float(timeout if timeout is not None else os.environ.get("AUTOPAR_TIMEOUT", "300"))
    pm = ParallelModel(model, loss_fn, plan, optimizer=optimizer, options=dict(
        weights=weights, mixed_precision=mixed_precision, seed=seed, init_fn=init_fn, param_groups=param_groups,
        timeout=timedelta(seconds=seconds), generated=generated, grad_reduce=grad_reduce,
        bucket_bytes=int(bucket_mb * 2**20), local_transfers=local_transfers))
    if loss_fn is None or example_target is not None:
        pm.prepare(tuple(example_inputs), example_target)
    return pm


class ParallelModel:
    """A model split into pipeline stages with F/I/W programs, trained by ``step``."""

    def __init__(self, model: nn.Module, loss_fn, plan: Plan | None, *, optimizer=None, options: dict):
        self.model = model
        self.loss_fn = loss_fn
        self.plan = plan                      # as resolved once built (microbatch count filled in)
        self.planner_summary: str | None = None  # what the planner chose and predicted (plan=None)
        self.optimizer = None                 # made at build time, over the parameters this rank trains
        self.timeout = options["timeout"]
        self._optimizer_factory = optimizer
        self._options = options
        self._built: _build.Built | None = None

    def prepare(self, inputs: tuple, target=None) -> _build.Built:
        """Capture and build now, for this global batch (``step`` does it at its first call)."""
        if self._built is None:
            b = self._built = _build.build(self.model, inputs, target, self.loss_fn, self.plan,
                                           optimizer=self._optimizer_factory, **self._options)
            self.plan, self.optimizer = b.plan, b.optimizer
            self.planner_summary = b.planner_summary or self.planner_summary
        return self._built

    # -- training ---------------------------------------------------------------------------

    def step(self, inputs, target=None) -> torch.Tensor:
        """One optimizer step over the global batch; returns the loss (design.md §5)."""
        inputs = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
        if self.loss_fn is not None and target is None:
            raise ValueError("autopar: step needs a target when a loss_fn was given")
        b = self.prepare(inputs, target)
        plan, m = b.plan, b.num_microbatches
        batch = _build.batch_size(inputs, target)
        if (batch != b.microbatch_size * plan.dp * m or tuple(x.shape[1:] for x in inputs) != b.input_shapes
                or (target is not None and b.target_shape is not None and tuple(target.shape[1:]) != b.target_shape)):
            raise ValueError(f"autopar: step got inputs {[tuple(x.shape) for x in inputs]} but the program was "
                             f"captured for a global batch of {b.microbatch_size * plan.dp * m} with per-sample "
                             f"shapes {[tuple(s) for s in b.input_shapes]}; shapes are static, re-parallelize for "
                             "new shapes")
        names = b.captured.inputs + ([b.captured.target] if b.captured.target else [])
        tensors = list(inputs) + ([target] if b.captured.target else [])
        cp = b.parallelisms.get("cp")
        local = cp.local if cp is not None else (lambda t: t)
        # every cp rank holds 1/cp of each sequence: its local mean loss gets 1/cp of the weight
        n_total = plan.dp * m * plan.cp
        b.parallelisms["dp"].zero_grads()
        total = None
        for replica in ([b.mesh.dp_rank] if b.mesh is not None else range(plan.dp)):
            mbs = []
            for k in range(m):
                lo = (replica * m + k) * b.microbatch_size
                mbs.append({n: local(t[lo: lo + b.microbatch_size]) for n, t in zip(names, tensors)})
            loss = b.executor.run(mbs, 1.0 / n_total)
            total = loss if total is None else total + loss
        if self.optimizer is not None:
            self.optimizer.step()
        return total

    # -- state ------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """Full tensors under the original FQNs (tied parameters under every name).

        In distributed mode every rank gets every tensor: each parameter and buffer comes from
        the pipeline rank that holds it (buffers from this process's replica); ZeRO-3 shards
        and expert-parallel shards are gathered first.
        """
        b = self._built
        if b is None:
            return self.model.state_dict()
        whole = {}
        for owner in b.parallelisms.values():
            whole.update(owner.whole())
        canonical = b.parallelisms["pp"].canonical
        local = {k: whole.get(canonical.get(k, k), v) for k, v in self.model.state_dict(keep_vars=True).items()}
        return b.parallelisms["pp"].gather_state(local)

    def load_state_dict(self, state_dict, strict: bool = True):
        """Load whole tensors by FQN: every rank writes what it holds, each owner its shards."""
        b = self._built
        if b is None:
            return self.model.load_state_dict(state_dict, strict=strict)
        current = self.model.state_dict(keep_vars=True)
        missing = [k for k in current if k not in state_dict]
        unexpected = [k for k in state_dict if k not in current]
        if strict and (missing or unexpected):
            raise RuntimeError(f"autopar: load_state_dict: missing keys {missing[:5]}, unexpected keys "
                               f"{unexpected[:5]} (strict=True)")
        canonical = b.parallelisms["pp"].canonical
        sharded = set().union(*(o.sharded for o in b.parallelisms.values()))
        plain = [k for k in current if k in state_dict and canonical.get(k, k) not in sharded
                 and not current[k].is_meta]  # a tensor of another rank's stage stays on meta
        wrong = [k for k in plain if tuple(current[k].shape) != tuple(state_dict[k].shape)]
        if wrong:
            k = wrong[0]
            raise RuntimeError(f"autopar: load_state_dict: {k} has shape {tuple(state_dict[k].shape)} in the state "
                               f"dict, the model's is {tuple(current[k].shape)} ({len(wrong)} such keys)")
        with torch.no_grad():
            for k in plain:
                current[k].copy_(state_dict[k])
        values = {canonical.get(k, k): v for k, v in state_dict.items()}
        for owner in b.parallelisms.values():
            owner.load_whole(values)
        return IncompatibleKeys(missing, unexpected)

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
        return stage_table(b.programs, b.schedule)

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
