"""`autopar.parallelize`: the one orchestrator, in a fixed order with one log line per step.

    validate plan -> capture (model + loss, one microbatch) -> split_stages -> split_backward
    -> build schedule -> executor (local mode: every rank's program in this process)
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from dataclasses import dataclass, replace
from datetime import timedelta

import torch
import torch.nn as nn

from autopar.plan import Plan

log = logging.getLogger("autopar")


def parallelize(model: nn.Module, example_inputs, loss_fn=None, optimizer=None, plan: Plan | None = None, *,
                example_target=None, timeout: float | None = None, generated: bool = True,
                grad_reduce: str = "bucketed", bucket_mb: float = 25.0, local_transfers: bool = False) -> "ParallelModel":
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
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    if plan is not None and _distributed():
        world = torch.distributed.get_world_size()
        if plan.world_size != world:
            # raised on every rank, before any communication
            raise ValueError(f"autopar: plan needs pp*dp*cp = {plan.pp}*{plan.dp}*{plan.cp} = {plan.world_size} ranks "
                             f"but the process group has {world}; launch {plan.world_size} processes or change the plan")
    pm = ParallelModel(model, tuple(example_inputs), loss_fn, optimizer, plan, timeout=timeout, generated=generated,
                       grad_reduce=grad_reduce, bucket_bytes=int(bucket_mb * 2**20), local_transfers=local_transfers)
    if loss_fn is None or example_target is not None:
        pm._build(tuple(example_inputs), example_target)
    return pm


@dataclass
class _Built:
    captured: object
    stages: list
    programs: list
    schedule: object
    executor: object
    microbatch_size: int
    num_microbatches: int
    input_shapes: tuple
    target_shape: tuple | None


class ParallelModel:
    """A model split into pipeline stages with F/I/W programs, trained by ``step``."""

    def __init__(self, model: nn.Module, example_inputs: tuple, loss_fn, optimizer, plan: Plan | None,
                 timeout: float | None = None, generated: bool = True, grad_reduce: str = "bucketed",
                 bucket_bytes: int = 25 * 2**20, local_transfers: bool = False):
        self.model = model
        self.local_transfers = local_transfers
        self.loss_fn = loss_fn
        self.plan = plan
        self.planner_summary: str | None = None  # what the planner chose and predicted (plan=None)
        self._example_inputs = example_inputs
        self._params = _unique_params(model)
        self._optimizer_factory = optimizer
        self.optimizer = None  # made at build time, over the parameters this rank trains
        self._built: _Built | None = None
        self.timeout = timedelta(seconds=float(timeout if timeout is not None else os.environ.get("AUTOPAR_TIMEOUT", "300")))
        self.generated = generated
        self.grad_reduce, self.bucket_bytes = grad_reduce, bucket_bytes
        self._mesh = None
        self._expert_shards: dict = {}  # fqn -> ExpertShard of parameters sharded by expert parallelism

    # -- building ---------------------------------------------------------------------------

    def _build(self, inputs: tuple, target) -> None:
        from autopar import schedules
        from autopar.passes import capture, split_backward, split_stages
        from autopar.passes.split_backward import StageInfo, differentiable_outputs
        from autopar.runtime import LocalPipeline

        batch = _batch_size(inputs, target)
        if self.plan is None:
            self.plan, self.planner_summary = _auto_plan(self.model, inputs, target, self.loss_fn, batch)
        plan = self.plan
        m = plan.num_microbatches or _default_microbatches(plan, batch)
        if batch % (plan.dp * m):
            raise ValueError(f"autopar: global batch {batch} is not divisible by dp*num_microbatches = "
                             f"{plan.dp}*{m} = {plan.dp * m}; use a batch that is a multiple of {plan.dp * m} "
                             "or change num_microbatches")
        mb = batch // (plan.dp * m)
        self.plan = plan = replace(plan, num_microbatches=m)  # the plan as resolved, e.g. for printing
        mesh = None
        if _distributed():
            from autopar.runtime.mesh import build_mesh

            mesh = build_mesh(plan.pp, plan.dp, self.timeout, cp=plan.cp, ep=plan.ep)
        elif plan.cp > 1 or plan.ep > 1:
            raise ValueError(f"autopar: cp={plan.cp}, ep={plan.ep} need one process per rank (they exchange data by "
                             "all-to-all); launch under torchrun (or `autopar demo --nproc N`), or use cp=1, ep=1")
        self._mesh = mesh
        if plan.cp > 1:
            _check_sequence_shardable(inputs, target, plan.cp)
        if plan.ep > 1:
            from autopar.passes.expert_parallel import apply_expert_parallel

            self._expert_shards = apply_expert_parallel(self.model, plan.ep, mesh.ep_rank, mesh.ep_group)
            self._params = _unique_params(self.model)
            log.info("autopar: expert parallel over %d ranks: %d expert parameters sharded", plan.ep,
                     len(self._expert_shards))
        t0 = time.perf_counter()
        schedule = schedules.build(plan.schedule, plan.pp, m, stages_per_rank=plan.stages_per_rank)
        log.info("autopar: schedule %s, pp=%d, %d stages, %d microbatches of %d", plan.schedule, plan.pp,
                 plan.num_stages, m, mb)
        mb_inputs = tuple(self._local(x[:mb]) for x in inputs)
        mb_target = self._local(target[:mb]) if target is not None else None
        captured = capture(self.model, mb_inputs, mb_target, self.loss_fn)
        log.info("autopar: captured %s in %.2fs", captured.summary(), time.perf_counter() - t0)
        if plan.cp > 1:
            from autopar.passes.context_parallel import apply_context_parallel

            apply_context_parallel(captured, plan.cp, mesh.cp_rank, mesh.cp_group)
            log.info("autopar: context parallel over %d ranks: attention rewritten to all-to-all (Ulysses)", plan.cp)
        t1 = time.perf_counter()
        stages = split_stages(captured, plan.num_stages, cuts=list(plan.stage_cuts) if plan.stage_cuts else None)
        log.info("autopar: split into %d stages (cost %s) in %.2fs", len(stages),
                 ", ".join(f"{s.cost * 1e3:.2f}" for s in stages), time.perf_counter() - t1)
        t2 = time.perf_counter()
        trainable = {fqn for fqn, p in self._params.items() if p.requires_grad}
        # A process traces the joint graphs of its own stages only; for the others it needs just
        # which outputs carry a gradient (one fake forward each). Local mode holds every stage.
        mine = set(range(len(stages)))
        if _distributed():
            pp_rank = torch.distributed.get_rank() % plan.pp
            mine = {s for s, r in enumerate(schedule.stage_to_rank) if r == pp_rank}
        programs, requires = [], {}
        for st in stages:
            if st.index in mine:
                prog = split_backward(st, requires, trainable, recompute=st.index in plan.recompute)
            else:
                prog = StageInfo(st, differentiable_outputs(st, requires, trainable))
            requires = {name: True for name in prog.diff_outputs}
            programs.append(prog)
        log.info("autopar: split backward into F/I/W for %d of %d stages in %.2fs", len(mine), len(programs),
                 time.perf_counter() - t2)
        state = {}
        for fqn, p in self._params.items():
            state[f"param:{fqn}"] = p
        for fqn, b in self.model.named_buffers():
            state[f"buffer:{fqn}"] = b
        for name, c in captured.constants.items():
            state[f"const:{name}"] = c
        if mesh is not None:
            from autopar.runtime.distributed import DistributedPipeline
            from autopar.runtime.mesh import add_tied_groups

            lowered = schedules.lower(schedule)
            add_tied_groups(mesh, stages, trainable, schedule.stage_to_rank, self.timeout)
            device = next(iter(self._params.values())).device
            executor = DistributedPipeline(programs, schedule, lowered, state, self._params, mesh, self.timeout, device,
                                           grad_reduce=self.grad_reduce, bucket_bytes=self.bucket_bytes,
                                           zero=plan.zero, expert_params=frozenset(self._expert_shards))
            if self.generated:
                from autopar.runtime.codegen import compile_step, generate_source

                src = generate_source(lowered.actions[mesh.pp_rank], schedule.stage_to_rank, mesh.pp_rank)
                executor.program = compile_step(src)
            trained = [self._params[f] for f in executor.my_params]
            log.info("autopar: rank %d is %s, stages %s%s", mesh.rank, mesh.describe(), executor.my_stages,
                     f", ZeRO-{executor.zero}" if executor.zero else "")
        else:
            transfers = None
            if self.local_transfers:
                from autopar.runtime.streams import CommStream

                transfers = CommStream(next(iter(self._params.values())).device)
            executor = LocalPipeline(programs, schedule, state, self._params, transfers=transfers)
            trained = [p for p in self._params.values() if p.requires_grad]
        if self._optimizer_factory is not None:
            self.optimizer = _make_optimizer(self._optimizer_factory, trained, executor, mesh, self._params)
        self._built = _Built(captured, stages, programs, schedule, executor, mb, m,
                             tuple(x.shape[1:] for x in inputs), None if target is None else target.shape[1:])

    # -- training ---------------------------------------------------------------------------

    def step(self, inputs, target=None) -> torch.Tensor:
        """One optimizer step over the global batch; returns the loss (design.md §5)."""
        if isinstance(inputs, torch.Tensor):
            inputs = (inputs,)
        inputs = tuple(inputs)
        if self.loss_fn is not None and target is None:
            raise ValueError("autopar: step needs a target when a loss_fn was given")
        if self._built is None:
            self._build(inputs, target)
        b = self._built
        batch = _batch_size(inputs, target)
        if self.plan is None:
            self.plan, self.planner_summary = _auto_plan(self.model, inputs, target, self.loss_fn, batch)
        plan = self.plan
        target_changed = target is not None and b.target_shape is not None and tuple(target.shape[1:]) != tuple(b.target_shape)
        if (batch != b.microbatch_size * plan.dp * b.num_microbatches or target_changed
                or tuple(x.shape[1:] for x in inputs) != b.input_shapes):
            raise ValueError(f"autopar: step got inputs {[tuple(x.shape) for x in inputs]} but the program was captured "
                             f"for a global batch of {b.microbatch_size * plan.dp * b.num_microbatches} with per-sample "
                             f"shapes {[tuple(s) for s in b.input_shapes]}; shapes are static, re-parallelize for new shapes")
        names = b.captured.inputs + ([b.captured.target] if b.captured.target else [])
        tensors = list(inputs) + ([target] if b.captured.target else [])
        # every cp rank holds 1/cp of each sequence: its local mean loss gets 1/cp of the weight
        n_total = plan.dp * b.num_microbatches * plan.cp
        for p in self._params.values():
            p.grad = None
        total = None
        mesh = self._mesh
        replicas = [mesh.dp_rank] if mesh is not None else range(plan.dp)
        for replica in replicas:
            mbs = []
            for k in range(b.num_microbatches):
                lo = (replica * b.num_microbatches + k) * b.microbatch_size
                mbs.append({n: self._local(t[lo: lo + b.microbatch_size]) for n, t in zip(names, tensors)})
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
        mesh = self._mesh if b is not None else None
        if mesh is None:
            return self.model.state_dict()
        with self._whole_parameters(write_back=False):
            if mesh.pp > 1:
                self._broadcast_from_owners()
            return {k: v.clone() for k, v in self.model.state_dict().items()}

    def load_state_dict(self, state_dict, strict: bool = True):
        if self._mesh is None or self._built is None:
            return self.model.load_state_dict(state_dict, strict=strict)
        with self._whole_parameters(write_back=True):
            result = self.model.load_state_dict(state_dict, strict=strict)
        reload = getattr(self.optimizer, "reload", None)
        if reload is not None:
            reload()
        return result

    def _broadcast_from_owners(self) -> None:
        from autopar.runtime import comms

        b, mesh = self._built, self._mesh
        owners = {}
        for prog in b.programs:
            r = b.schedule.stage_to_rank[prog.stage.index]
            for fqn in prog.stage.params + prog.stage.buffers:
                owners.setdefault(fqn, r)
        canonical = {}
        for names in b.captured.aliases.values():
            for n in names:
                canonical[n] = names[0]
        with torch.no_grad():
            for fqn, t in self.model.state_dict(keep_vars=True).items():
                owner = owners.get(canonical.get(fqn, fqn))
                if owner is not None:
                    comms.broadcast(t.data, src=mesh.global_rank(owner), group=mesh.pp_group)

    @contextlib.contextmanager
    def _whole_parameters(self, write_back: bool):
        """Give every parameter its whole value for the duration (collective on every rank);
        afterwards re-shard: from the (possibly loaded) whole values when write_back."""
        from autopar.runtime import comms

        sharded = getattr(self._built.executor, "sharded", None)
        streamed = sharded is not None and sharded.zero == 3
        saved = {}
        if streamed:
            for fqn, v in sharded.whole().items():
                saved[fqn] = self._params[fqn].data
                self._params[fqn].data = v
        for fqn, shard in self._expert_shards.items():
            p = self._params[fqn]
            saved.setdefault(fqn, p.data)
            p.data = comms.all_gather_dim0(p.data.contiguous(), self._mesh.ep_group)
        try:
            yield
        finally:
            for fqn, shard in self._expert_shards.items():
                p = self._params[fqn]
                if write_back:
                    n = p.shape[0] // shard.ep
                    p.data = p.data[shard.ep_rank * n: (shard.ep_rank + 1) * n].clone()
                else:
                    p.data = saved[fqn]
            if sharded is not None and write_back:
                sharded.load({f: self._params[f].data for f in sharded.group_of})
            if streamed:
                for fqn in saved:
                    if fqn in sharded.group_of:
                        self._params[fqn].data = saved[fqn]

    @property
    def stages(self):
        self._require_built("stages")
        return self._built.stages

    @property
    def programs(self):
        self._require_built("programs")
        return self._built.programs

    @property
    def schedule(self):
        self._require_built("schedule")
        return self._built.schedule

    @property
    def executed_actions(self) -> list[list[str]] | list[str]:
        """The compute actions of the last step in the order they ran: per rank in local mode,
        this rank's list in distributed mode."""
        self._require_built("executed_actions")
        return self._built.executor.executed

    def stage_table(self) -> str:
        from autopar.inspect import stage_table

        self._require_built("stage_table")
        return stage_table(self._built.programs, self._built.schedule)

    def dump(self, directory: str) -> list[str]:
        """Write every stage's F, I, W, B code as Python plus a stage table; returns the paths."""
        from autopar.inspect import dump_programs

        self._require_built("dump")
        os.makedirs(directory, exist_ok=True)
        from autopar import schedules
        from autopar.runtime.codegen import generate_source

        b = self._built
        paths = dump_programs(b.programs, b.schedule, self.plan, directory)
        lowered = schedules.lower(b.schedule)
        for r, acts in enumerate(lowered.actions):
            path = os.path.join(directory, f"rank{r}_step.py")
            with open(path, "w") as fh:
                fh.write(f"# autopar: what pipeline rank {r} runs each step ({b.schedule.name}, "
                         f"{b.schedule.num_microbatches} microbatches); rt is runtime.distributed.DistributedPipeline\n")
                fh.write(generate_source(acts, b.schedule.stage_to_rank, r))
            paths.append(path)
        return paths

    def _require_built(self, what: str) -> None:
        if self._built is None:
            raise RuntimeError(f"autopar: {what} needs the captured program; pass example_target= to parallelize "
                               "or run one step first")

    def _local(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's share of a batch tensor along the sequence (dim 1) under context parallelism."""
        cp = self.plan.cp if self.plan is not None else 1
        if cp == 1 or self._mesh is None:
            return t
        n = t.shape[1] // cp
        return t.narrow(1, self._mesh.cp_rank * n, n).contiguous()


def _auto_plan(model: nn.Module, inputs: tuple, target, loss_fn, batch: int) -> Plan:
    """Ask the planner for this world; rank 0 decides (device profiles are measured per process,
    so ranks could disagree) and broadcasts the plan."""
    world = torch.distributed.get_world_size() if _distributed() else 1
    rank = torch.distributed.get_rank() if _distributed() else 0
    text = None
    if rank == 0:
        from autopar.planner import plan_model
        from autopar.planner.devices import current_profile
        from autopar.planner.report import text as report_text
        from autopar.planner.search import to_plan

        device = current_profile()
        limit = float(device.memory_bytes)
        if device.name == "cpu":  # the ranks' processes share this host's memory
            limit /= int(os.environ.get("LOCAL_WORLD_SIZE", world))
        t0 = time.perf_counter()
        # CP is not searched here: the planner knows the head counts, but not whether the CP pass
        # can rewrite this model (it refuses explicit attention masks, for one), and a chosen
        # cp > 1 would then fail; set Plan(cp=...). EP is, for models built from autopar.nn.MoE
        experts = [m.n_experts for m in model.modules() if _is_autopar_moe(m)]
        res, info = plan_model(model, inputs, target, loss_fn, gpus=world, global_batch=batch, device=device,
                               memory_limit=limit, allow_cp=False, allow_ep=bool(experts),
                               n_experts=min(experts, default=0), expert_prefixes=("experts.",),
                               zero_levels=(0, 1, 2, 3),
                               name=type(model).__name__, progress=lambda msg: log.info("autopar planner: %s", msg))
        if res.chosen is None:
            text = "error:" + report_text(res, info)
        else:
            chosen = to_plan(res, res.chosen)
            est = res.chosen.estimate
            summary = (f"planner: {res.chosen.layout.label()} on the {device.name} profile, predicted step "
                       f"{est.step_time * 1e3:.3g} ms, peak memory {max(est.peak_memory) / 2**20:.1f} MiB on the "
                       f"heaviest rank ({len(res.feasible())} feasible plans priced in {time.perf_counter() - t0:.1f} s)")
            log.info("autopar: %s; plan %s", summary, chosen.to_json())
            text = json.dumps({"plan": chosen.to_json(), "summary": summary})
    if _distributed():
        box = [text]
        torch.distributed.broadcast_object_list(box, src=0)
        text = box[0]
    if text.startswith("error:"):
        raise ValueError("autopar: no plan fits this world; the planner's report:\n" + text[len("error:"):])
    data = json.loads(text)
    return Plan.from_json(data["plan"]), data["summary"]


def _check_sequence_shardable(inputs: tuple, target, cp: int) -> None:
    for what, t in [(f"input {i}", x) for i, x in enumerate(inputs)] + ([("the target", target)] if target is not None else []):
        if t.dim() < 2 or t.shape[1] % cp:
            raise ValueError(f"autopar: cp={cp} shards every input and the target along dim 1 (the sequence), but "
                             f"{what} has shape {tuple(t.shape)}; use a sequence length divisible by {cp} "
                             "or cp=1")


def _make_optimizer(factory, trained: list, executor, mesh, params: dict):
    """The user's optimizer over what this rank trains, sharded per the plan's ZeRO level
    (expert-parallel shards are stepped whole beside the ZeRO shards)."""
    zero = getattr(executor, "zero", 0)  # local mode runs unsharded
    if zero == 0:
        return factory(trained)
    experts = [params[f] for f in executor.expert_params]
    if zero == 1:
        from autopar.runtime.zero import ZeroOneOptimizer

        plain = [params[f] for f in executor.my_params if f not in set(executor.expert_params)]
        return ZeroOneOptimizer(plain, factory, mesh.replica_group, mesh.replicas, mesh.replica, others=experts)
    from autopar.runtime.sharded import ShardedOptimizer

    return ShardedOptimizer(executor.sharded, factory, experts)


def _is_autopar_moe(module: nn.Module) -> bool:
    from autopar.nn import MoE

    return isinstance(module, MoE)


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _unique_params(model: nn.Module) -> dict[str, nn.Parameter]:
    """Canonical FQN (first name) -> Parameter, tied parameters once."""
    out, seen = {}, set()
    for fqn, p in model.named_parameters(remove_duplicate=False):
        if id(p) not in seen:
            seen.add(id(p))
            out[fqn] = p
    return out


def _batch_size(inputs: tuple, target) -> int:
    for i, x in enumerate(inputs):
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"autopar: input {i} is a {type(x).__name__}; pass the model's inputs as a tuple of "
                             "tensors (one per forward argument)")
    sizes = {tuple(x.shape[:1]) for x in inputs} | ({tuple(target.shape[:1])} if target is not None else set())
    if len(sizes) != 1 or () in sizes:
        shapes = [tuple(x.shape) for x in inputs] + ([tuple(target.shape)] if target is not None else [])
        raise ValueError(f"autopar: every input and the target must share the batch size in dim 0; got shapes {shapes}")
    return next(iter(sizes))[0]


def _default_microbatches(plan: Plan, batch: int) -> int:
    """Smallest microbatch count >= 2*pp the schedule accepts that divides the batch per replica."""
    from autopar import schedules

    per_replica = batch // plan.dp if batch % plan.dp == 0 else 0
    divisors = [m for m in range(1, per_replica + 1) if per_replica % m == 0]
    accepted = []
    for m in divisors:
        try:
            schedules.build(plan.schedule, plan.pp, m, stages_per_rank=plan.stages_per_rank)
        except ValueError:
            continue
        accepted.append(m)
    preferred = [m for m in accepted if m >= 2 * plan.pp]
    if preferred:
        return preferred[0]
    if accepted:
        return accepted[-1]
    raise ValueError(f"autopar: no microbatch count works for schedule {plan.schedule} with pp={plan.pp}, "
                     f"dp={plan.dp} and global batch {batch}; pass num_microbatches explicitly or change the batch")
