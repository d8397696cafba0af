"""The orchestrator: from a model, one global batch and a plan to this process's executor.

``build`` is a flat list of steps, each a function with keyword arguments and one log line:

    plan        the planner's choice when no plan is given (rank 0 decides, every rank takes it)
    validate    the plan resolved for the batch (microbatch count), checked against the world;
                the checkpoint's names, shapes and dtypes checked against the model's (tied
                parameters it stores under one name tied as the model declares them)
    buffers     non-persistent buffers on the meta device recomputed the way their modules
                compute them (runtime/materialize.buffer_values), before any process group
    mesh        every process group (distributed mode only)
    module      module rewrites before capture (ExpertParallel)
    capture     model + loss on one microbatch (passes/capture.py); a model on the meta device
                or under mixed precision is captured on fake tensors of the compute dtype
    graph       graph rewrites of the capture (ContextParallel)
    split       pipeline stages (passes/split_stages.py), the last one's loss chunked when the
                plan says so (passes/chunked_loss.py), and the schedule (schedules/)
    programs    F/I/W/B of this process's stages (passes/split_backward.stage_programs)
    executor    the step's owners: PipelineParallel, DataParallel (materializes what this
                process trains from the live model, a checkpoint or the init; masters, compute
                copies, ZeRO storage; may rewrite the programs, ZeRO-3), then the rest of what
                this process holds, and the local or distributed executor (runtime/)
    optimizer   the user's optimizer, wrapped by the data-parallel owner for its ZeRO level

The planner's profiler (planner/profile.py) uses the same ``stage_programs`` step.
"""
from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field, replace

import torch
import torch.nn as nn

from autopar import batches, schedules
from autopar.collectives import moe_exchange
from autopar.passes.grad_mode import params_with_gradient
from autopar.passes.token_loss import ignore_index_of
from autopar.plan import Plan

log = logging.getLogger("autopar")


@dataclass
class Built:
    """What ``build`` made: the resolved plan, the capture and its stages, this process's
    programs (as they run), the schedule, the executor and every parallelism owner."""

    plan: Plan
    captured: object
    stages: list
    programs: list
    schedule: object
    executor: object
    params: dict                   # canonical FQN -> Parameter (tied parameters once)
    microbatch_size: int
    input_shapes: tuple
    target_shape: tuple | None
    mesh: object = None
    parallelisms: dict = field(default_factory=dict)  # name ("pp", "dp", "cp", "ep") -> owner
    optimizer: object = None
    prediction: dict | None = None  # the planner's summary and predicted step time / peak, when it planned
    device: torch.device = torch.device("cpu")
    checkpoint: object = None      # runtime/weights.CheckpointReader the weights came from (bytes_read ...)
    moe_entries: tuple = ()        # its dropless experts modules' dispatch entries (collectives/moe_exchange.py)
    # the loss is a token mean of the target ignoring this index (passes/token_loss.py): the
    # step is normalized by the valid target entries of the global batch; None otherwise
    target_ignore_index: int | None = None

    @property
    def num_microbatches(self) -> int:
        return self.plan.num_microbatches


def build(model: nn.Module, inputs: tuple, target, loss_fn, plan: Plan | None, *, optimizer=None,
          weights=None, mixed_precision=None, seed: int = 0, init_fn=None, param_groups=None, timeout=None,
          generated: bool = True, grad_reduce: str = "bucketed", bucket_bytes: int = 25 * 2**20,
          local_transfers: bool = False, local_replicas: int = 1, input_names=None, compile=None) -> Built:
    """Every step of ``parallelize`` after its argument checks (see the module docstring).
    ``local_replicas``: the inputs are one dp replica's batch (``batch="local"``): the global
    batch is that many times theirs. ``compile``: overrides ``plan.compile`` (None: keep it)."""
    if compile is not None and not isinstance(compile, bool):
        raise ValueError(f"autopar.parallelize: compile={compile!r} must be True, False or None (the plan's)")
    batch = batch_size(inputs, target) * local_replicas
    prediction = None
    if plan is None:
        plan, prediction = choose_plan(model=model, inputs=inputs, target=target, loss_fn=loss_fn, batch=batch,
                                       input_names=input_names, optimizer=planned_optimizer(optimizer),
                                       compile=bool(compile),
                                    precision=mixed_precision)
    if compile is not None and plan.compile != compile:
        plan = replace(plan, compile=compile)
    whole = {f: (tuple(t.shape), t.dtype) for f, t in model.state_dict(keep_vars=True).items()}  # before rewrites
    plan, checkpoint = validate(plan=plan, batch=batch, model=model, weights=weights, whole=whole,
                                precision=mixed_precision, init_fn=init_fn)
    inputs, input_names = batches.with_shift_labels(inputs, input_names, model, loss_fn, plan.cp)
    buffers = recompute_buffers(model=model, seed=seed, init_fn=init_fn)
    mesh = make_mesh(plan=plan, timeout=timeout)
    owners = rewrite_module(model=model, plan=plan, mesh=mesh, inputs=inputs, target=target)
    mb = batch // (plan.dp * plan.num_microbatches)
    cp = owners.get("cp")
    local = cp.local if cp is not None else (lambda t: t)
    entries = moe_exchange.entries_of(model)  # what the dispatch ops find while the graph is built and timed
    with moe_exchange.serving(entries):
        captured = capture_microbatch(model=model, inputs=tuple(local(x[:mb]) for x in inputs),
                                      target=local(target[:mb]) if target is not None else None, loss_fn=loss_fn,
                                      precision=mixed_precision, input_names=input_names, causal_masks=cp is None)
        captured = same_graph_everywhere(captured=captured, mesh=mesh)
        captured = rewrite_graph(captured=captured, owners=owners)
        stages, schedule = split(captured=captured, plan=plan)
        params = unique_params(model)
        # what requires grad and gets a gradient somewhere (not a parameter used inside no_grad alone)
        trainable = {f for f, p in params.items() if p.requires_grad} & params_with_gradient(captured)
        options = param_options(model=model, spec=param_groups, aliases=aliases_of(model))
        routes = route_optimizer(factory=optimizer, captured=captured, options=options)
        if routes is not None and "tp" in owners:  # Muon's matrices that tp shards: gathered for Newton-Schulz
            owners["tp"].mark_gathered(options)
        programs = make_programs(stages=stages, schedule=schedule, plan=plan, mesh=mesh, trainable=trainable)
        values = weight_values(model=model, checkpoint=checkpoint, whole=whole, seed=seed, init_fn=init_fn,
                               owners=owners, device=input_device(inputs), buffers=buffers)
        executor, programs = make_executor(model=model, captured=captured, stages=stages, programs=programs,
                                           schedule=schedule, plan=plan, mesh=mesh, owners=owners, params=params,
                                           trainable=trainable, values=values, precision=mixed_precision,
                                           options=options,
                                           device=input_device(inputs), timeout=timeout, generated=generated,
                                           grad_reduce=grad_reduce, bucket_bytes=bucket_bytes,
                                           local_transfers=local_transfers)
    opt = make_optimizer(factory=optimizer, owners=owners, routes=routes)
    return Built(plan=plan, captured=captured, stages=stages, programs=programs, schedule=schedule,
                 executor=executor, params=params, microbatch_size=mb, input_shapes=tuple(x.shape[1:] for x in inputs),
                 target_shape=None if target is None else tuple(target.shape[1:]), mesh=mesh, parallelisms=owners,
                 optimizer=opt, prediction=prediction, checkpoint=checkpoint[0] if checkpoint else None,
                 device=input_device(inputs), moe_entries=tuple(entries.values()),
                 target_ignore_index=ignore_index_of(captured) if loss_fn is not None else None)


# -- the steps --------------------------------------------------------------------------------


def planned_optimizer(factory) -> str:
    """What the planner prices for an optimizer factory: "muon" for ``autopar.Muon``, else
    "adamw" (Adam's two states an element: what every other torch optimizer keeps at most)."""
    from autopar.muon import Muon

    return "muon" if isinstance(factory, Muon) else "adamw"


def choose_plan(*, model: nn.Module, inputs: tuple, target, loss_fn, batch: int, precision=None,
                world: int | None = None, input_names=None, optimizer: str = "adamw",
                compile: bool = False) -> tuple[Plan, dict]:
    """Ask the planner for this world (``world``: its size, default the process group's);
    ``optimizer``: what it prices ("adamw" or "muon", ``planned_optimizer``); ``compile``: the
    units timed compiled by Inductor and the plan run so (``Plan.compile``);
    rank 0 decides (device profiles are measured per process, so ranks could disagree) and
    broadcasts the plan."""
    rank = torch.distributed.get_rank() if distributed() else 0
    if world is None:
        world = torch.distributed.get_world_size() if distributed() else 1
    text = None
    if rank == 0:
        from autopar.planner import eager_model_options, plan_model
        from autopar.planner.devices import current_profile
        from autopar.planner.report import text as report_text
        from autopar.planner.search import to_plan

        device = current_profile()
        limit = float(device.memory_bytes)
        if device.name == "cpu":  # the ranks' processes share this host's memory
            limit /= int(os.environ.get("LOCAL_WORLD_SIZE", world))
        t0 = time.perf_counter()
        # the space `autopar plan --model` searches (planner.eager_model_options): CP where the
        # context-parallel pass can rewrite the model (the planner asks it per degree), EP where
        # the EP rewrite recognizes the model's MoE blocks, TP where the tensor-parallel pass
        # shards something, within a node of the device profile; the log names the axes
        opts = eager_model_options(model)
        for why in opts["ep_refused"]:
            log.info("autopar planner: ep not searched: %s", why)
        res, _info = plan_model(model, inputs, target, loss_fn, gpus=world, global_batch=batch, device=device,
                                memory_limit=limit, allow_cp=True, allow_ep=opts["allow_ep"], allow_tp=True,
                                precision=precision, input_names=input_names, n_experts=opts["n_experts"],
                                expert_prefixes=opts["expert_prefixes"], zero_levels=(0, 1, 2, 3),
                                name=type(model).__name__, optimizer=optimizer, compile=compile,
                                progress=lambda msg: log.info("autopar planner: %s", msg))
        priced: dict[tuple[int, int], list[str]] = {}
        for c in res.candidates:
            if c.estimate is not None and (c.layout.cp > 1 or c.layout.ep > 1 or c.layout.tp > 1):
                priced.setdefault((c.layout.cp, c.layout.ep, c.layout.tp), []).append(c.layout.label())
        for (cp, ep, tp), labels in sorted(priced.items()):
            log.info("autopar planner: priced %d layouts with cp=%d ep=%d tp=%d, e.g. %s", len(labels), cp, ep, tp,
                     labels[0])
        if res.chosen is None:
            text = "error:" + report_text(res, _info)
        else:
            chosen = to_plan(res, res.chosen)
            est = res.chosen.estimate
            summary = (f"planner: {res.chosen.layout.label()} on the {device.name} profile, predicted step "
                       f"{est.step_time * 1e3:.3g} ms, peak memory {max(est.peak_memory) / 2**20:.1f} MiB on the "
                       f"heaviest rank ({len(res.feasible())} feasible plans priced in "
                       f"{time.perf_counter() - t0:.1f} s)")
            log.info("autopar: %s; plan %s", summary, chosen.to_json())
            text = json.dumps({"plan": chosen.to_json(), "summary": summary, "step_s": est.step_time,
                               "peak_bytes": max(est.peak_memory)})
    if distributed():
        box = [text]
        torch.distributed.broadcast_object_list(box, src=0)
        text = box[0]
    if text.startswith("error:"):
        raise ValueError("autopar: no plan fits this world; the planner's report:\n" + text[len("error:"):])
    data = json.loads(text)
    return Plan.from_json(data["plan"]), {"summary": data["summary"], "predicted_step_s": data["step_s"],
                                          "predicted_peak_bytes": data["peak_bytes"]}


def check_world(plan: Plan) -> None:
    """ValueError (on every rank, before any communication) when the plan does not fit the
    process group."""
    if distributed() and plan.world_size != torch.distributed.get_world_size():
        world = torch.distributed.get_world_size()
        raise ValueError(f"autopar: plan needs pp*dp*cp*tp = {plan.pp}*{plan.dp}*{plan.cp}*{plan.tp} = "
                         f"{plan.world_size} ranks but the process group has {world}; launch {plan.world_size} "
                         "processes or change the plan")


def validate(*, plan: Plan, batch: int, model: nn.Module, weights, whole: dict, precision, init_fn):
    """(the plan with its microbatch count resolved, the checkpoint reader and the name to read
    for every model tensor, or None); ValueError (before any communication) when the plan does
    not fit the batch or the world, or the checkpoint does not fit the model."""
    check_world(plan)
    if plan.ep > 1:  # a block EP cannot shard is refused here, before any process group
        from autopar.parallel.expert import ExpertParallel

        ExpertParallel.check_module(model, plan.ep)
    checkpoint = None
    if weights is not None:
        from autopar.runtime.materialize import tie_declared
        from autopar.runtime.weights import check_against, open_weights

        reader = open_weights(weights)
        for absent, stored in tie_declared(model, set(reader.meta)):  # tied as the model ties them
            log.info("autopar: %s is not in %s: tied to %s, as the model declares", absent, reader.describe, stored)
        checkpoint = (reader, check_against(reader, whole, aliases_of(model)))
    elif any(t.is_meta for t in model.state_dict(keep_vars=True).values()):
        from autopar.runtime.materialize import has_init

        if not has_init(model, init_fn):
            raise ValueError(f"autopar: {type(model).__name__} is on the meta device and nothing gives it values: pass "
                             "weights= (a checkpoint), init_fn=, or give the model an init_weights() or its modules "
                             "reset_parameters()")
    if not distributed() and (plan.cp > 1 or plan.ep > 1 or plan.tp > 1):
        raise ValueError(f"autopar: cp={plan.cp}, ep={plan.ep}, tp={plan.tp} need one process per rank (they "
                         "exchange data by collectives); launch under torchrun (or `autopar demo --nproc N`), or use "
                         "cp=1, ep=1, tp=1")
    m = plan.num_microbatches or default_microbatches(plan, batch)
    if batch % (plan.dp * m):
        raise ValueError(f"autopar: global batch {batch} is not divisible by dp*num_microbatches = "
                         f"{plan.dp}*{m} = {plan.dp * m}; use a batch that is a multiple of {plan.dp * m} "
                         "or change num_microbatches")
    schedules.check(plan.schedule, plan.pp, m, plan.stages_per_rank)
    plan = replace(plan, num_microbatches=m)
    log.info("autopar: plan pp=%d dp=%d cp=%d ep=%d tp=%d %s, %d stages, %d microbatches of %d, ZeRO-%d", plan.pp,
             plan.dp, plan.cp, plan.ep, plan.tp, plan.schedule, plan.num_stages, m, batch // (plan.dp * m), plan.zero)
    return plan, checkpoint


def make_mesh(*, plan: Plan, timeout):
    """Every process group of the plan's mesh (None in local mode)."""
    if not distributed():
        return None
    from autopar.runtime.mesh import build_mesh

    mesh = build_mesh(plan.pp, plan.dp, timeout, cp=plan.cp, ep=plan.ep, tp=plan.tp)
    log.info("autopar: rank %d is %s", mesh.rank, mesh.describe())
    return mesh


def rewrite_module(*, model: nn.Module, plan: Plan, mesh, inputs: tuple, target) -> dict:
    """The owners that act before capture: ContextParallel (checks the inputs' sequence
    length), ExpertParallel (shards the experts of the model in place); TensorParallel, which
    acts on the capture."""
    owners = {}
    if plan.tp > 1:  # acts on the capture first (rewrite_graph): CP then splits the rank's heads
        from autopar.parallel.tensor import TensorParallel

        owners["tp"] = TensorParallel(tp=plan.tp, mesh=mesh, model=model, sequence_parallel=plan.sequence_parallel)
    if plan.cp > 1:
        from autopar.parallel.context import ContextParallel

        owners["cp"] = ContextParallel(cp=plan.cp, mesh=mesh)
        owners["cp"].check_inputs(inputs, target)
    if plan.ep > 1:
        from autopar.parallel.expert import ExpertParallel

        owners["ep"] = ExpertParallel(ep=plan.ep, mesh=mesh)
        owners["ep"].rewrite_module(model)
    from autopar.passes import moe_dispatch

    for name, module in model.named_modules():  # the dropless experts: the plan's receive ratios
        if hasattr(module, "_autopar_dispatch_key"):
            moe_dispatch.set_receive_policy(module, plan.moe_imbalance, plan.moe_receive_limit)
    return owners


def capture_microbatch(*, model: nn.Module, inputs: tuple, target, loss_fn, precision=None, input_names=None,
                       causal_masks: bool = True):
    """The capture of one microbatch. A model with tensors on the meta device, or under mixed
    precision, is captured with fake tensors in place of its own (floating parameters in the
    compute dtype) and fake inputs: shapes and dtypes are all a capture reads. ``causal_masks``:
    ``passes.capture``'s (off for a sequence shard under context parallelism)."""
    from autopar import passes

    t0 = time.perf_counter()
    tensors = {**dict(model.named_buffers()), **model.state_dict(keep_vars=True)}  # non-persistent buffers too
    if precision is None and not any(t.is_meta for t in tensors.values()):
        captured = passes.capture(model, inputs, target, loss_fn, input_names,  # looked up here: tests may memoize it
                                  causal_masks=causal_masks)
    else:
        from torch._subclasses.fake_tensor import FakeTensorMode

        from autopar.runtime.materialize import swapped

        device = input_device(inputs)
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        params = {id(p) for p in model.parameters()}
        with mode:
            fakes = {f: torch.empty(t.shape, device=device, dtype=precision.param_dtype
                                    if precision is not None and id(t) in params and t.is_floating_point() else t.dtype)
                     for f, t in tensors.items()}
            fake_in = tuple(torch.empty_like(x, device=device) for x in inputs)
            fake_target = torch.empty_like(target, device=device) if target is not None else None
        with swapped(model, fakes):
            captured = passes.capture(model, fake_in, fake_target, loss_fn, input_names, causal_masks=causal_masks)
    log.info("autopar: captured %s in %.2fs", captured.summary(), time.perf_counter() - t0)
    return captured


def same_graph_everywhere(*, captured, mesh):
    """Distributed: every rank continues from global rank 0's node order and names
    (passes/align.py), so model code whose trace order follows the Python hash seed (iterating
    over a set of strings) gives every rank the same stage cuts and boundaries, the same order
    of collectives and the same parameter order per stage, without PYTHONHASHSEED. A rank that
    cannot align is an error on every rank."""
    if mesh is None or mesh.world == 1:
        return captured
    from autopar.collectives import comms
    from autopar.passes.align import align, fingerprints

    groups = comms.group_names()
    reference = comms.broadcast_object(fingerprints(captured, groups), src=0)
    error = None
    try:
        captured = align(captured, reference, groups)
    except ValueError as e:
        error = f"rank {mesh.rank}: {e}"
    errors = [e for e in comms.all_gather_object(error) if e is not None]
    if errors:
        raise ValueError("\n".join(errors))
    return captured


def rewrite_graph(*, captured, owners: dict):
    for owner in owners.values():
        captured = owner.rewrite_capture(captured)
    return captured


def split(*, captured, plan: Plan):
    from autopar.passes import split_stages
    from autopar.passes.chunked_loss import chunk_stage_loss

    t0 = time.perf_counter()
    stages = split_stages(captured, plan.num_stages, cuts=list(plan.stage_cuts) if plan.stage_cuts else None)
    stages = [chunk_stage_loss(st, plan.loss_chunk_tokens) for st in stages]
    schedule = schedules.build(plan.schedule, plan.pp, plan.num_microbatches, stages_per_rank=plan.stages_per_rank)
    log.info("autopar: split into %d stages (cost %s) in %.2fs; schedule %s", len(stages),
             ", ".join(f"{s.cost * 1e3:.2f}" for s in stages), time.perf_counter() - t0, schedule.name)
    return stages, schedule


def make_programs(*, stages: list, schedule, plan: Plan, mesh, trainable: set[str]) -> list:
    """This process traces the joint graphs of its own stages only; for the others it needs
    just which outputs carry a gradient (one fake forward each). Local mode holds every stage."""
    from autopar.passes.split_backward import stage_programs

    t0 = time.perf_counter()
    held = None if mesh is None else set(schedule.stages_of(mesh.pp_rank))
    programs = stage_programs(stages, trainable, held=held, recompute=plan.recompute,
                              remake={s for s in range(len(stages)) if plan.remakes(s)})
    log.info("autopar: split backward into F/I/W for %d of %d stages in %.2fs",
             len(stages) if held is None else len(held), len(stages), time.perf_counter() - t0)
    return programs


def _compile_programs(plan: Plan, programs: list, stages) -> list:
    """With ``plan.compile``, this process's F/I/W/B programs marked to run compiled by Inductor
    (runtime/compiled.py; each compiles at its first call); else ``programs``."""
    if not plan.compile:
        return programs
    from autopar.runtime.compiled import compiled_programs

    stages = list(stages)
    log.info("autopar: %d stage program(s) run compiled by Inductor (each compiles at its first call)",
             4 * len(stages))
    return compiled_programs(programs, stages)


def recompute_buffers(*, model: nn.Module, seed: int, init_fn) -> dict:
    """The non-persistent buffers on the meta device (in no checkpoint, computed by their modules'
    constructors: RoPE tables, position ids), recomputed on the CPU the way their modules compute
    them (runtime/materialize.buffer_values); every rank computes them, before any process group
    exists, so one it cannot is a ValueError on every rank before any communication. They are
    small; each rank keeps those its stages read (``make_executor``)."""
    from autopar.runtime.materialize import buffer_values

    t0 = time.perf_counter()
    buffers = buffer_values(model, seed=seed, init_fn=init_fn)
    if buffers:
        log.info("autopar: recomputed %d non-persistent buffer(s) on meta (%s) in %.2fs", len(buffers),
                 ", ".join(list(buffers)[:3]) + (", ..." if len(buffers) > 3 else ""), time.perf_counter() - t0)
    return buffers


def weight_values(*, model: nn.Module, checkpoint, whole: dict, seed: int, init_fn, owners: dict, device,
                  buffers: dict | None = None):
    """``values(fqns) -> {fqn: tensor}``: the values this process gives the tensors it holds and
    that are on the meta device, from the checkpoint or the init, and non-persistent buffers from
    ``buffers`` (``recompute_buffers``), as this process keeps them (an expert shard's rows), on
    ``device``."""
    buffers = buffers or {}
    from autopar.runtime.materialize import CheckpointValues, InitValues, has_init

    init = None
    if has_init(model, init_fn):
        init = InitValues(model, seed, init_fn, {f: s for f, (s, _d) in whole.items()},
                          {f: d for f, (_s, d) in whole.items()})
    source = init if checkpoint is None else CheckpointValues(*checkpoint, init, {f: d for f, (_s, d) in whole.items()})
    rows = {f: sh.rows for f, sh in owners["ep"].shards.items()} if "ep" in owners else {}
    tp = owners.get("tp")
    tp_shards = tp.shards if tp is not None else {}

    def values(fqns):
        if source is None:
            raise AssertionError("validate() let a meta model through without weights or an init")
        out = {f: buffers[f] for f in fqns if f in buffers}
        fqns = [f for f in fqns if f not in out]
        for f in fqns:  # an expert shard or a tp block: read only the part this rank keeps
            if f in rows and isinstance(source, CheckpointValues) and f in source.source_of:
                out[f] = source.rows(f, rows[f])
            elif f in tp_shards and isinstance(source, CheckpointValues) and f in source.source_of:
                sh = tp_shards[f]
                out[f] = torch.cat([source.rows(f, idx) for idx in sh.pieces()], sh.dim)
        for f, v in source.get([f for f in fqns if f not in out]).items():
            out[f] = v[rows[f]] if f in rows else tp.local_of(f, v).clone() if tp is not None else v
        return {f: v.to(device) for f, v in out.items()}

    return values


def make_executor(*, model: nn.Module, captured, stages: list, programs: list, schedule, plan: Plan, mesh,
                  owners: dict, params: dict, trainable: set[str], values, precision, options: dict, device,
                  timeout, generated: bool, grad_reduce: str, bucket_bytes: int, local_transfers: bool):
    """The pipeline and data-parallel owners, the rest of this process's tensors, then the
    executor; returns it and the programs as it runs them (ZeRO-3 rewrites them)."""
    from autopar.parallel.data import DataParallel
    from autopar.parallel.pipeline import PipelineParallel
    from autopar.passes import keys
    from autopar.runtime.materialize import assign, check_materialized
    from autopar.runtime.streams import CommStream

    pipeline = PipelineParallel(schedule=schedule, stages=stages, trainable=trainable, aliases=captured.aliases,
                                mesh=mesh, timeout=timeout, device=device)
    owners["pp"] = pipeline
    mine = pipeline.my_stages
    comm = CommStream(device)
    dp = DataParallel(zero=plan.zero, mesh=mesh, model=model, params=params,
                      stage_params={s: _trained_here(programs[s], stages[s], pipeline) for s in mine},
                      expert_params=owners["ep"].sharded if "ep" in owners else frozenset(),
                      grad_reduce=grad_reduce, bucket_bytes=bucket_bytes, timeout=timeout, comm=comm,
                      precision=precision, values=values, device=device, options=options,
                      owner_of=lambda fqn: pipeline.rank is None or pipeline.owner_of.get(fqn) == pipeline.rank,
                      tp_sharded=owners["tp"].sharded if "tp" in owners else frozenset())
    owners["dp"] = dp
    # what else this process's stages read: parameters without a gradient, buffers (compute dtype)
    held_params, held_buffers = pipeline.held(stages)
    tensors = {**dict(model.named_buffers()), **model.state_dict(keep_vars=True)}  # non-persistent buffers too
    read = {f for f in tensors if f in held_buffers or (f in held_params and f not in dp.sharded)}
    # non-persistent buffers no stage reads (original_inv_freq) are kept too: the model is whole where
    # the plan allows, at the cost of a few small tables (every rank computed them, recompute_buffers)
    unread = set(tensors) - set(model.state_dict(keep_vars=True)) - {f for st in stages for f in st.buffers}
    rest = {f: t for f, t in tensors.items() if t.is_meta and (f in read or f in unread) and f not in dp.trained}
    if rest:
        got = values(rest)
        if precision is not None:
            got = {f: v.to(precision.param_dtype) if f in held_params and v.is_floating_point() else v
                   for f, v in got.items()}
        assign(model, got)
    check_materialized(model, sorted(read))
    params.update(unique_params(model))
    state = keys.state(params, dict(model.named_buffers()), captured.constants)
    materialized = sum(t.numel() * t.element_size() for t in params.values() if not t.is_meta)
    log.info("autopar: %.1f MiB of parameters on this process (%d of %d tensors real)", materialized / 2**20,
             sum(1 for t in params.values() if not t.is_meta and t.numel()), len(params))
    if mesh is None:
        from autopar.runtime.local import LocalPipeline

        transfers = CommStream(device) if local_transfers else None
        programs = _compile_programs(plan, programs, range(len(programs)))
        executor = LocalPipeline(programs, schedule, state, dp.grads, transfers=transfers)
        attach_offload(executor=executor, plan=plan, device=device)
        return executor, programs
    from autopar.runtime.distributed import DistributedPipeline

    rewritten = dp.rewrite_programs({s: programs[s] for s in mine})
    programs = [rewritten.get(s, p) for s, p in enumerate(programs)]
    programs = _compile_programs(plan, programs, mine)
    executor = DistributedPipeline(programs, schedule, schedules.lower(schedule), state, mesh, timeout, device,
                                   data_parallel=dp, pipeline=pipeline, generated=generated, comm=comm)
    log.info("autopar: rank %d runs stages %s%s", mesh.rank, mine, f", ZeRO-{dp.zero}" if dp.zero else "")
    attach_offload(executor=executor, plan=plan, device=device)
    return executor, programs


def attach_offload(*, executor, plan: Plan, device) -> None:
    """The plan's activation offload (runtime/offload.py) on the executor's stages, if any."""
    fractions = {s: plan.offload_of(s) for s in executor.work.programs}
    if not any(fractions.values()):
        return
    from autopar.runtime.offload import ActivationOffload

    executor.work.offload = ActivationOffload(executor.work.programs, fractions, device)
    chosen = executor.work.offload.keys
    log.info("autopar: offloading %s saved value(s) of stages %s to host memory", sum(map(len, chosen.values())),
             sorted(s for s, ks in chosen.items() if ks))


def route_optimizer(*, factory, captured, options: dict) -> dict | None:
    """An optimizer factory that routes parameters from the graph (``autopar.Muon``): FQN ->
    its Route, and each parameter's route put into ``options`` under the user's own
    ``param_groups`` options (they win); None for other factories."""
    if not callable(getattr(factory, "routes", None)):
        return None
    from autopar.muon import route_options

    routes = factory.routes(captured)
    for f, opts in route_options(routes).items():
        options[f] = {**opts, **options.get(f, {})}
    return routes


def make_optimizer(*, factory, owners: dict, routes: dict | None = None):
    """The user's optimizer over what this process trains, wrapped for the ZeRO level and the
    masters of mixed precision (None without a factory); ``routes``: the graph's routing of the
    parameters, kept on the optimizer (``pm.optimizer.routes``, its repr prints them)."""
    if factory is None:
        return None
    opt = owners["dp"].make_optimizer(factory)
    if routes is not None:
        getattr(opt, "inner", opt).routes = routes
    return opt


# -- helpers ----------------------------------------------------------------------------------


def distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def param_options(*, model: nn.Module, spec, aliases: dict[str, list[str]]) -> dict[str, dict]:
    """Canonical FQN -> the options of its parameter group, from ``spec``: a callable
    ``(fqn, parameter) -> dict`` (e.g. ``lambda fqn, p: {"weight_decay": 0.0} if p.ndim < 2 else
    {}``) or a list of groups naming parameters by FQN (``[{"params": ["norm.weight", ...],
    "weight_decay": 0.0}]``; parameters in no group get the optimizer's defaults)."""
    if spec is None:
        return {}
    canonical = {n: names[0] for names in aliases.values() for n in names}
    params = unique_params(model)
    if callable(spec):
        out = {}
        for f, p in params.items():
            opts = spec(f, p) or {}
            if not isinstance(opts, dict) or "params" in opts:
                raise ValueError(f"autopar: param_groups({f!r}, p) must return a dict of options without 'params', "
                                 f"got {opts!r}")
            out[f] = dict(opts)
        return out
    out: dict[str, dict] = {}
    for i, group in enumerate(spec):
        if not isinstance(group, dict) or "params" not in group:
            raise ValueError(f"autopar: param_groups[{i}] must be a dict with 'params' (a list of FQNs), got {group!r}")
        opts = {k: v for k, v in group.items() if k != "params"}
        for f in group["params"]:
            f = canonical.get(f, f)
            if f not in params:
                raise ValueError(f"autopar: param_groups[{i}] names {f!r}, which is not a parameter of "
                                 f"{type(model).__name__} (e.g. {list(params)[:3]})")
            if f in out:
                raise ValueError(f"autopar: {f!r} is in two of param_groups")
            out[f] = opts
    return out


def input_device(inputs: tuple) -> torch.device:
    return inputs[0].device if inputs else torch.device("cpu")


def aliases_of(model: nn.Module) -> dict[str, list[str]]:
    """Canonical FQN -> every name of that parameter (tied weights have several)."""
    names: dict[int, list[str]] = {}
    for fqn, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(fqn)
    return {v[0]: v for v in names.values() if len(v) > 1}


def unique_params(model: nn.Module) -> dict[str, nn.Parameter]:
    """Canonical FQN (first name) -> Parameter, tied parameters once."""
    out, seen = {}, set()
    for fqn, p in model.named_parameters(remove_duplicate=False):
        if id(p) not in seen:
            seen.add(id(p))
            out[fqn] = p
    return out


def batch_size(inputs: tuple, target) -> int:
    for i, x in enumerate(inputs):
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"autopar: input {i} is a {type(x).__name__}; pass the model's inputs as a tuple of "
                             "tensors (one per forward argument)")
    sizes = {tuple(x.shape[:1]) for x in inputs} | ({tuple(target.shape[:1])} if target is not None else set())
    if len(sizes) != 1 or () in sizes:
        shapes = [tuple(x.shape) for x in inputs] + ([tuple(target.shape)] if target is not None else [])
        raise ValueError(f"autopar: every input and the target must share the batch size in dim 0; got shapes {shapes}")
    return next(iter(sizes))[0]


def default_microbatches(plan: Plan, batch: int) -> int:
    """Smallest microbatch count >= 2*pp the schedule accepts that divides the batch per replica."""
    per_replica = batch // plan.dp if batch % plan.dp == 0 else 0
    accepted = []
    for m in [m for m in range(1, per_replica + 1) if per_replica % m == 0]:
        try:
            schedules.check(plan.schedule, plan.pp, m, plan.stages_per_rank)
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


def _trained_here(program, stage, pipeline) -> tuple[str, ...]:
    """The parameters this rank steps for ``stage``: those its programs give a gradient, and the
    tied ones it holds even where its own use gets none (a parameter used inside a no-grad
    region here and with gradient on another pipeline rank): the holders sum one gradient and
    step alike, or this rank's copy would go stale."""
    tied = pipeline.mesh.tied_groups if pipeline.mesh is not None else {}
    return tuple(dict.fromkeys(program.grad_params + tuple(f for f in stage.params if f in tied)))

