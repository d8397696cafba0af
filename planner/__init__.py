"""autopar.planner: cost and memory model from the captured graph, and the search over plans.

    res, info = plan_model(model, inputs, target, loss_fn, gpus=16, global_batch=64, device=get_profile("h100"))
    res.chosen.layout, res.chosen.estimate.step_time, res.chosen.estimate.peak_memory

Modules: ``profile`` (model -> per-unit costs; ``unit_kind``: one unit as priced), ``devices`` /
``comm`` (device profiles, alpha-beta collectives), ``estimate`` (time and memory of one
candidate: ``Evaluator``, composed of ``time_model``, ``memory_model`` and ``offload_model``;
``layout``: the plan as data; ``inflight``: a schedule's in-flight counts), ``ilp`` (stage-
boundary ILP), ``search`` (the rounds), ``report`` (table and JSON), ``presets`` (meta-device
models), ``cli``.
"""
from __future__ import annotations


def plan_model(model=None, inputs=None, target=None, loss_fn=None, *, gpus: int, global_batch: int, device=None,
               memory_limit: float | None = None, exhaustive: bool = False, schedules=None,
               allow_cp: bool = True, allow_ep: bool = True, zero_levels=(0, 1, 2, 3), progress=None,
               allow_tp: bool = True, name: str = "model", layer_repeats=None, expert_prefixes=("expert",),
               n_heads: int = 0, n_experts: int = 0, seq_len: int | None = None, ilp_nodes: int | None = None,
               precision=None, input_names=None, pin=None, moe=None, moe_imbalance: float | None = None,
               hf_config: str | None = None, loss_chunking: bool = True, offloading: bool = True,
               optimizer: str = "adamw", profile_cache: bool = False, compile: bool = False):
    """Profile ``model`` and search plans for ``gpus`` devices; returns (PlanResult, profile info).
    ``precision``: an ``autopar.MixedPrecision``: the model is profiled in its ``param_dtype``
    and priced with bf16 compute copies, fp32 masters and fp32 gradients. ``pin``: a dict of
    Layout fields to hold fixed (e.g. ``{"pp": 16, "ep": 64, "zero": 1}``); the rest is searched.
    ``moe``: the dropless MoE config (``n_experts``, ``top_k``, ``expert_hidden``, ``d_model``,
    ``dtype``; presets carry it as ``PresetModel.moe``), checked against the captured dispatch
    ops (which are what prices the token-proportional dispatch); ``moe_imbalance``: max/mean
    rows an EP rank receives (default 1.25). ``hf_config``: a Hugging Face ``config.json`` (or
    its directory) instead of ``model``/``inputs``: its causal LM is built on the meta device
    (planner/hf_config.py; ``seq_len`` default 4096). ``ilp_nodes``: branch-and-bound nodes per
    stage-boundary ILP (default ``planner.ilp.DEFAULT_NODES``): every budget of the search counts
    work, so the answer is the same on every machine. ``loss_chunking``: where memory binds,
    also price the model's LM head + cross-entropy chunked (``Plan.loss_chunk_tokens``);
    ``offloading``: and saved activations parked on the host (``Plan.offload``). ``optimizer``:
    "adamw" or "muon" (``autopar.Muon``: one momentum per hidden-matrix element instead of Adam's
    two, and Newton-Schulz on the matrices each rank steps). ``profile_cache``: read the model's
    profile from the disk cache, and write it there (planner/profile_cache.py; models on the
    meta device only: a profile timed on this machine is never cached). ``compile``: the plans run
    their programs compiled by Inductor (``Plan.compile``); on the measured cpu device the units
    are timed compiled."""
    from .devices import current_profile
    from .search import Request, plan

    if hf_config is not None:
        if model is not None:
            raise ValueError("plan_model: give a model or hf_config=, not both")
        from .hf_config import EXPERT_PREFIXES, build_from_config

        seq_len = seq_len or 4096
        hm = build_from_config(hf_config, seq_len=seq_len, say=progress or (lambda msg: None))
        model, inputs, target, loss_fn = hm.model, hm.inputs, hm.target, hm.loss_fn
        name, layer_repeats, expert_prefixes = hm.name, hm.layer_repeats or None, EXPERT_PREFIXES
        n_heads, n_experts = hm.n_heads, hm.n_experts
    elif model is None or inputs is None:
        raise ValueError("plan_model: give a model and its example inputs, or hf_config=")
    device = device or current_profile()
    options = dict(name=name, layer_repeats=layer_repeats, expert_prefixes=tuple(expert_prefixes), n_heads=n_heads,
                   n_experts=n_experts, seq_len=seq_len, moe=moe, input_names=input_names,
                   param_dtype=precision.param_dtype if precision is not None else None, compile=bool(compile))
    cps = tuple(cp for cp in range(2, gpus + 1) if gpus % cp == 0) if allow_cp else ()
    prof, verdicts, cached = _profile(model, inputs, target, loss_fn, options, cps, profile_cache, progress)
    kw = {}
    if moe_imbalance is not None:
        kw["moe_imbalance"] = float(moe_imbalance)
    if schedules:
        kw["schedules"] = tuple(schedules)
    if ilp_nodes is not None:
        kw["ilp_nodes"] = int(ilp_nodes)
    blocker = None
    if allow_cp and (prof.captured is not None or cached):
        blocker = verdicts.__getitem__
        for cp in cps:
            if progress is not None:
                why = verdicts[cp]
                progress(f"cp={cp}: " + ("the context-parallel pass can rewrite the model" if why is None
                                         else f"not searched: {why.splitlines()[0][:200]}"))
    req = Request(gpus=gpus, global_batch=global_batch, cp_blocker=blocker,
                  memory_limit=float(memory_limit if memory_limit is not None else device.memory_bytes),
                  exhaustive=exhaustive, allow_cp=allow_cp, allow_ep=allow_ep, allow_tp=allow_tp,
                  zero_levels=tuple(zero_levels),
                  pin=tuple((pin or {}).items()), loss_chunking=loss_chunking,
                  offloading=offloading, optimizer=optimizer, disk_cache=bool(profile_cache), **kw)
    res = plan(prof, device, req, progress=progress)
    info = {"capture_s": prof.capture_s, "trace_s": prof.trace_s, "parameters": prof.total_params,
            "units": len(prof.units), "profile_cached": cached}
    return res, info


def eager_model_options(model) -> dict:
    """What the planner searches for a user's eager model, read off the model: expert
    parallelism where the EP rewrite recognizes its MoE blocks (``autopar.nn.MoE``, Hugging
    Face MoE blocks: passes/expert_parallel.py), with their expert count and parameter prefixes;
    off (and why, in ``ep_refused``) where a block looks like an MoE the rewrite refuses.
    ``parallelize`` without a plan and ``autopar plan --model`` both plan with it, so both
    search the same layouts for the same request."""
    from autopar.passes.expert_parallel import expert_parameters, moe_blocks, refused_moe_blocks

    refused = refused_moe_blocks(model)
    blocks = [] if refused else moe_blocks(model)
    return {"allow_ep": bool(blocks), "n_experts": min((n for _f, n in blocks), default=0),
            "expert_prefixes": tuple(expert_parameters(model)) if blocks else (),
            "ep_refused": tuple(f"{fqn}: {why}" for fqn, why in refused)}


def _profile(model, inputs, target, loss_fn, options: dict, cps, use_cache: bool, progress):
    """(the model's profile, {cp: context-parallel verdict} for ``cps`` and cp=1, whether it
    came from the disk cache): ``profile_model``, or the cached profile when ``use_cache`` and
    planner/profile_cache.py has one for this model with every verdict asked for."""
    from autopar.passes.context_parallel import context_parallel_blocker

    from . import profile_cache
    from .profile import profile_model

    say = progress or (lambda msg: None)
    key = profile_cache.profile_key(model, inputs, target, loss_fn, options) if use_cache else None
    hit = profile_cache.load(key, cps) if key is not None else None
    if hit is not None:
        say(f"model profile from the cache ({profile_cache.cache_path(key)}; captured in "
            f"{hit[0].capture_s:.1f} s, traced in {hit[0].trace_s:.1f} s when made)")
        return hit[0], {1: None, **hit[1]}, True
    prof = profile_model(model, inputs, target, loss_fn, progress=progress, **options)
    verdicts = {cp: context_parallel_blocker(prof.captured, cp) for cp in cps} if prof.captured is not None else {}
    if key is not None:
        path = profile_cache.store(key, prof, verdicts)
        if path is not None:
            say(f"model profile cached at {path}")
    return prof, {1: None, **verdicts}, False
