"""P3: the planner's predicted per-rank peak memory vs the peak measured on 2 gloo processes.

    python benchmarks/memory_model.py        # --layers 8 --d-model 128 --heads 4 --seq 64 --batch 16
    python benchmarks/memory_model.py --plans 1f1b:4,gpipe:8,1f1b:4:bf16=1
    python benchmarks/memory_model.py --plans 1f1b:4:pp=1:dp=2:ep=2:zero=1      # the EP row alone

Model: ``autopar.examples.gpt`` (seeded; fp32; AdamW). Plans: one per item of ``--plans``,
``schedule:m[:pp=P:dp=D:ep=E:zero=Z:bf16=1]`` (default pp=2): by default pp=2 with 1f1b at 4 and 8
microbatches, gpipe, zb-h1, zbv and interleaved-1f1b at 8, and dp=2 (pp=1) with 4
microbatches at ZeRO-0 and ZeRO-1; then the same model under bf16 mixed precision
(``bf16=1``: ``autopar.MixedPrecision(param_dtype=torch.bfloat16)``, bf16 compute copies, fp32
masters and gradient accumulators, the loss computed on fp32 logits) as pp=2 1f1b m=4 and
zb-h1 m=8, and dp=2 m=4 at ZeRO-0, 1, 2 and 3; then the EP row.

EP row (``ep=E``, E > 1; by default dp=2 x ep=2, pp=1, ZeRO-1, 1f1b m=4): ep is carved out of
dp (world 2: both ranks hold half the experts and see different tokens). The model is the
smallest MoE of the same size flags: ``autopar.examples.llama`` with ``--layers`` blocks of
``--d-model`` width whose feed-forward is a dropless ``autopar.nn.MoE(capacity_factor=None)``
(``MOE_EXPERTS`` experts of hidden ``MOE_HIDDEN_MULT * d_model``, top ``MOE_TOP_K``), fp32,
AdamW; the experts' parameters are 1/ep per rank and, at dp = ep, unsharded by ZeRO-1 (their
expert-data-parallel group is one rank). The prediction is the planner's at the DEFAULT
``moe_imbalance`` (``planner.estimate.DEFAULT_MOE_IMBALANCE``, 1.25): a number fixed before the
run, as a user gets it, rather than the measured max/mean, which is only known afterwards. The
row prints the measured ``pm.metrics["moe_receive_ratio"]`` (the largest receive of one rank in
one dispatch over the step, against the mean) next to it: the prediction covers the measured
peak only while that ratio stays under the bound (the planner applies the bound to every MoE
layer of every microbatch in flight, the measured ratio is the single worst dispatch, so it
covers it with room). Measured: as for every row, plus the dispatch op's own allocations (the
received rows, the experts' activations under the op's private autograd graph, the rows'
gradients): a dispatch mode is popped while the op it intercepted runs, so the probe's mode is
re-entered inside the op's kernels (``probe_inside_kernels``), else they would be invisible.

Predicted: the planner in this process. ``profile_model`` captures ONE microbatch (the smallest
microbatch of the plans; the profile scales linearly to the others), ``Evaluator`` with the
measured ``cpu`` device profile, ``search.price`` prices each layout as the search would
(balanced stage boundaries, then the stage-boundary ILP), and ``search.to_plan`` turns it into
the ``autopar.Plan`` that runs, so predicted and measured runs have the same stage cuts. The
prediction per pipeline rank is ``Estimate.peak_memory`` (bytes), with its components
(weights, gradients, optimizer states, activations at the schedule's peak, one unit's working
set, P2P buffers, ...).

Measured: each plan runs on 2 gloo processes (spawned, FileStore rendezvous, one thread each).
Step 1 runs unobserved (AdamW creates its states). Step 2 runs inside
``autopar.runtime.memory_probe.PeakTensorMemory``: the peak of LIVE TENSOR BYTES in the
process during the step, i.e. the distinct storages of this rank's trained parameters, their
gradients and the optimizer's state tensors (the baseline, counted at entry) plus every
storage an ATen op creates during the step (activations, gradients, receive buffers,
optimizer temporaries), each subtracted when it is freed. Under mixed precision the baseline also holds the fp32
masters (``dp.masters`` under ZeRO-0; the ZeRO-1 flat shard, the ZeRO-2/3 group shards) and
the fp32 gradient accumulators (the masters' ``.grad``, ZeRO-1's ``dp.grads`` buffers, the
ZeRO-2/3 flat gradients), as the fp32 plans' baseline holds ``.grad`` and the AdamW states;
the compute copies are this rank's trained parameters. Not counted: allocator slack,
gloo's internal buffers, Python objects, and the parameters of the OTHER pipeline rank's
stages (every process builds the whole model; the runtime leaves those weights untouched, so
they are reported separately as "unused model copy").

Predicted for a bf16 plan: the same planner on a profile captured with bf16 parameters
(``profile_model(..., param_dtype=torch.bfloat16)``, so ``Precision.for_profile`` picks the
mixed-precision layout: 2 bytes of weights, 4 of gradients, 12 of optimizer = fp32 master +
Adam per element), whose stage cuts run.

Printed per plan and rank: predicted, measured, error = (predicted - measured) / measured,
the predicted breakdown and the measured baseline (parameters + gradients + optimizer states
at entry, in the planner's categories: compute copies are weights, fp32 accumulators are
gradients, fp32 masters are optimizer; bf16 plans print the masters on their own line too)
and step peak above it. Target (P3): every |error| <= 15% and no under-prediction by
more than 5% (error >= -5%). Exit code 0 when the run completed (PASS/FAIL is reported).
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
os.environ.setdefault("OMP_NUM_THREADS", "1")

from autopar.runtime.spawn import run_ranks  # noqa: E402

MAX_ERROR = 0.15
MOE_EXPERTS, MOE_TOP_K, MOE_HIDDEN_MULT = 4, 2, 2  # the EP row's MoE (module docstring)
MAX_UNDER = 0.05
DEFAULT_PLANS = ("1f1b:4,1f1b:8,gpipe:8,zb-h1:8,zbv:8,interleaved-1f1b:8,"
                 "1f1b:4:pp=1:dp=2:zero=0,1f1b:4:pp=1:dp=2:zero=1,"
                 "1f1b:4:bf16=1,zb-h1:8:bf16=1,1f1b:4:pp=1:dp=2:zero=0:bf16=1,1f1b:4:pp=1:dp=2:zero=1:bf16=1,"
                 "1f1b:4:pp=1:dp=2:zero=2:bf16=1,1f1b:4:pp=1:dp=2:zero=3:bf16=1,"
                 "1f1b:4:pp=1:dp=2:ep=2:zero=1")
MiB = 2 ** 20


# ------------------------------------------------------------------------------------------------
# planner side (shared with benchmarks/cost_model.py)


def add_model_args(ap, layers=8, d_model=128, heads=4, seq=64, batch=16, vocab=256) -> None:
    """The examples/gpt size flags every planner/runtime benchmark takes (``model_kwargs`` reads them)."""
    ap.add_argument("--layers", type=int, default=layers)
    ap.add_argument("--d-model", type=int, default=d_model)
    ap.add_argument("--heads", type=int, default=heads)
    ap.add_argument("--seq", type=int, default=seq)
    ap.add_argument("--batch", type=int, default=batch, help="global batch")
    ap.add_argument("--vocab", type=int, default=vocab)


def model_kwargs(args) -> dict:
    return dict(n_layer=args.layers, d_model=args.d_model, n_head=args.heads, seq_len=args.seq,
                batch_size=args.batch, vocab_size=args.vocab, seed=0)


def parse_plans(text: str, default_pp: int = 2) -> list[dict]:
    """``schedule:m[:pp=..:dp=..:ep=..:zero=..:bf16=1]`` items, comma-separated -> layout dicts."""
    out = []
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        parts = item.split(":")
        spec = {"schedule": parts[0], "m": int(parts[1]) if len(parts) > 1 else 8, "pp": default_pp, "dp": 1,
                "ep": 1, "zero": 0, "bf16": 0}
        for kv in parts[2:]:
            k, v = kv.split("=")
            if k not in spec or k in ("schedule", "m"):
                raise ValueError(f"plan item {item!r}: unknown key {k!r} (pp, dp, ep, zero, bf16)")
            spec[k] = int(v)
        if spec["ep"] > 1 and (spec["dp"] % spec["ep"] or spec["bf16"]):
            raise ValueError(f"plan item {item!r}: ep={spec['ep']} must divide dp={spec['dp']} (ep is carved out "
                             "of dp), and the EP row runs fp32 (no bf16=1)")
        out.append(spec)
    return out


def plan_label(spec: dict) -> str:
    z = f" zero={spec['zero']}" if spec["dp"] > 1 else ""
    mp = " bf16" if spec.get("bf16") else ""
    ep = f" ep={spec['ep']}" if spec.get("ep", 1) > 1 else ""
    return f"pp={spec['pp']} dp={spec['dp']}{ep} {spec['schedule']} m={spec['m']}{z}{mp}"


def make_moe(mk: dict):
    """The EP row's model (module docstring) at the size flags ``mk`` (``model_kwargs``):
    ``(model, (tokens,), target, llama_loss)``."""
    from autopar.examples.llama import LlamaConfig, make_llama

    d = mk["d_model"]
    cfg = LlamaConfig(vocab_size=mk["vocab_size"], d_model=d, n_layers=mk["n_layer"], n_heads=mk["n_head"],
                      n_kv_heads=mk["n_head"], ffn_hidden=4 * d, seq_len=mk["seq_len"], n_experts=MOE_EXPERTS,
                      top_k=MOE_TOP_K, expert_hidden=MOE_HIDDEN_MULT * d, capacity_factor=None)
    return make_llama(cfg, batch_size=mk["batch_size"], seed=mk["seed"])


def make_model(mk: dict, moe: bool):
    from autopar.examples.gpt import make_gpt

    return make_moe(mk) if moe else make_gpt(**mk)


def gpt_loss32(logits, target):
    """The GPT's cross entropy on fp32 logits (mixed precision: the bf16 logits upcast first)."""
    import torch.nn.functional as F

    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), target.reshape(-1))


def profile_and_price(mk: dict, specs: list[dict], say=print, profile_batch: int | None = None,
                      bf16_profile: str = "planner"):
    """Profile the model once, on one microbatch of ``profile_batch`` samples (default: the
    largest microbatch among ``specs``), and price every layout: [(spec, Candidate,
    autopar.Plan)], the Evaluator, the profile (of the fp32 plans when there are any). Specs
    with ``bf16`` are priced on a second profile, captured with bf16 parameters and the fp32
    loss (``gpt_loss32``), by their own Evaluator (``Precision.for_profile``: mixed precision).
    ``bf16_profile="planner"`` captures it as ``plan_model(..., precision=MixedPrecision())``
    and ``parallelize`` do (``profile_model(..., param_dtype=torch.bfloat16)``: fake tensors);
    ``"copy"`` profiles a real bf16 copy of the model instead (``model.to(torch.bfloat16)``,
    which keeps the tied embedding / head one Parameter; the fake-tensor path does not, see
    benchmarks/README.md).

    Why the largest: the planner scales a unit's time linearly from the captured microbatch
    (a fixed per-node overhead from the device profile plus a per-sample rest). On one CPU
    core the per-sample cost of tiny microbatches is not linear (cache-resident working sets,
    fixed kernel set-up costs), so extrapolating UP from one sample overestimates large
    microbatches badly, while extrapolating DOWN from a large one lands near the per-node
    overhead it should reach."""
    import torch

    from autopar.planner.devices import get_profile
    from autopar.planner.estimate import Evaluator, Layout
    from autopar.planner.profile import profile_model
    from autopar.planner.search import price, to_plan
    from autopar.schedules import default_stages_per_rank

    G = mk["batch_size"]
    for s in specs:
        if G % (s["dp"] * s["m"]):
            raise ValueError(f"global batch {G} is not divisible by dp*m for {plan_label(s)}")
    b0 = profile_batch or max(G // (s["dp"] * s["m"]) for s in specs)
    device = get_profile("cpu")
    evaluators = {}
    for mp, moe in sorted({(bool(s.get("bf16")), s.get("ep", 1) > 1) for s in specs}):
        model, (idx,), target, loss_fn = make_model(mk, moe)
        t0 = time.perf_counter()
        if moe:  # the EP row's dropless MoE: the planner prices its dispatch ops (planner.routed.routed_of)
            prof = profile_model(model, (idx[:b0],), target[:b0], loss_fn, name="moe",
                                 expert_prefixes=(".experts.",), n_experts=MOE_EXPERTS)
            what = (f"llama with dropless MoE ({MOE_EXPERTS} experts, top {MOE_TOP_K}, hidden "
                    f"{MOE_HIDDEN_MULT * mk['d_model']})")
        elif mp and bf16_profile == "copy":
            import copy

            prof = profile_model(copy.deepcopy(model).to(torch.bfloat16), (idx[:b0],), target[:b0], gpt_loss32,
                                 name="gpt")
            what = "a bf16 copy of gpt (mixed precision)"
        else:
            prof = profile_model(model, (idx[:b0],), target[:b0], gpt_loss32 if mp else loss_fn, name="gpt",
                                 param_dtype=torch.bfloat16 if mp else None)
            what = "gpt with bf16 parameters (mixed precision)" if mp else "gpt"
        say(f"planner: profiled {what} on one microbatch of {b0} in {time.perf_counter() - t0:.1f} s "
            f"({len(prof.units)} units, {prof.total_params} parameters); device profile: {device.source}")
        n_model = sum(p.numel() for p in model.parameters())  # each Parameter once (the tied one once)
        if prof.total_params != n_model:
            names: dict[int, list[str]] = {}
            for f, p in model.named_parameters(remove_duplicate=False):
                names.setdefault(id(p), []).append(f)
            tied = [" = ".join(v) for v in names.values() if len(v) > 1]
            say(f"NOTE: this profile counts {prof.total_params - n_model} parameter elements more than the model "
                f"has ({n_model}): the capture it priced does not share the model's tied {', '.join(tied)} "
                f"(profile.shared_params = {prof.shared_params}), so a rank holding both users counts it twice")
        # the default moe_imbalance (DEFAULT_MOE_IMBALANCE) for the EP row: see the module docstring
        evaluators[mp, moe] = Evaluator(prof, device, float(device.memory_bytes), G)
    out = []
    for s in specs:
        ev = evaluators[bool(s.get("bf16")), s.get("ep", 1) > 1]
        v = 1 if s["pp"] == 1 else default_stages_per_rank(s["schedule"])
        lay = Layout(pp=s["pp"], dp=s["dp"], cp=1, ep=s.get("ep", 1), schedule=s["schedule"], v=v, m=s["m"],
                     b=G // (s["dp"] * s["m"]), zero=s["zero"])
        cand = price(ev, lay)
        out.append((s, cand, to_plan(ev, cand)))
    ev = next(evaluators[k] for k in sorted(evaluators))  # the fp32 gpt's when there is one
    return out, ev, ev.profile


# ------------------------------------------------------------------------------------------------
# rank side


def inner_optimizer(opt):
    """The user's optimizer inside autopar's wrappers (mixed-precision masters, ZeRO-1/2/3), the
    one that steps the tensors it was given and holds their states."""
    while hasattr(opt, "inner") or hasattr(opt, "optimizer"):
        opt = getattr(opt, "inner", None) or opt.optimizer
    return opt


def optimizer_state_tensors(opt) -> list:
    """Every tensor the user's optimizer steps or keeps: the tensors in its parameter groups
    (the parameters themselves for fp32 without ZeRO; otherwise fp32 masters: whole under mixed
    precision, the ZeRO-1 flat shards, the ZeRO-2/3 group shards) and its states (AdamW's step,
    exp_avg, exp_avg_sq)."""
    import torch

    inner = inner_optimizer(opt)
    out = [p for g in inner.param_groups for p in g["params"]]
    for st in inner.state.values():
        out += [v for v in st.values() if isinstance(v, torch.Tensor)]
    return out


def trained_params(pm) -> list:
    """The tensors this rank's programs read for the parameters it trains (under mixed
    precision the bf16 compute copies; under ZeRO-3 the resident views and empty streamed ones)."""
    b = pm.built
    return [b.params[f] for f in b.parallelisms["dp"].trained]


def master_tensors(pm) -> list:
    """The tensors the optimizer steps that are not the ones the programs read: fp32 masters
    (mixed precision; ZeRO-1/2/3 shards)."""
    mine = {t.untyped_storage()._cdata for t in trained_params(pm) if not t.is_meta}
    return [p for g in inner_optimizer(pm.optimizer).param_groups for p in g["params"]
            if p.untyped_storage()._cdata not in mine]


def gradient_tensors(pm) -> list:
    """Where this rank's gradients accumulate: the trained parameters' ``.grad``; under mixed
    precision the fp32 masters' ``.grad`` (ZeRO-0) or ``dp.grads``' fp32 buffers (ZeRO-1); the
    ZeRO-1/2/3 shards' summed gradients (the masters' ``.grad``) and the ZeRO-2/3 flat fp32
    gradients, where they exist."""
    dp = pm.built.parallelisms["dp"]
    out = [p.grad for p in trained_params(pm)]
    out += [m.grad for m in getattr(dp, "masters", {}).values()]
    out += list(getattr(dp.grads, "buffers", {}).values())  # parallel.data._Buffers
    out += [p.grad for p in master_tensors(pm)]
    if dp.storage is not None:
        out += [g.grad_full for g in dp.storage.groups]
    return [t for t in out if t is not None]


def gather_buffers(pm) -> list:
    """ZeRO-3's two gather buffers (they live as long as the storage)."""
    storage = pm.built.parallelisms["dp"].storage
    return list(storage.buffers) if storage is not None else []


def state_tensors(pm) -> dict:
    """This rank's training state at a step's entry, in the planner's categories: weights (the
    tensors the programs read, ZeRO-3's resident groups among them; under ZeRO-3 also the fp32
    master shards), gradients (the accumulators), optimizer (states and the other fp32 masters),
    ZeRO-3's gather buffers."""
    zero3 = master_tensors(pm) if pm.built.parallelisms["dp"].zero == 3 else []  # the planner's ZeRO-3 weights
    return {"weights": trained_params(pm) + zero3, "gradients": gradient_tensors(pm),
            "optimizer": optimizer_state_tensors(pm.optimizer), "zero-3 gather": gather_buffers(pm)}


def _categorized_bytes(state: dict) -> dict:
    """Bytes per category, each storage once, in the first category that holds it."""
    from autopar.runtime.memory_probe import storage_bytes

    out, seen = {}, []
    for name, tensors in state.items():
        out[name] = storage_bytes(seen + list(tensors)) - storage_bytes(seen)
        seen += list(tensors)
    return out


# the Python bodies of autopar's custom ops' kernels, by module: what they allocate inside is
# invisible to a dispatch mode (popped while the op it intercepted runs) unless re-entered there
KERNEL_BODIES = {
    "autopar.collectives.moe_exchange": ("send_rows", "run_experts", "combine_rows", "send_grads", "input_grads",
                                     "combine_grads", "weight_grads"),
    "autopar.linear_ce": ("_forward", "_grad_weight"),
}


class probe_inside_kernels:
    """While active, every kernel body of autopar's custom ops (``KERNEL_BODIES``: the dropless
    MoE dispatch, the chunked cross-entropy) runs under ``probe``'s dispatch mode, so the
    storages the ops create inside (the dispatch's state between F, I and W, the loss's chunk
    buffers) are counted and freed like any other (module docstring)."""

    def __init__(self, probe):
        self.probe, self.saved = probe, []

    def __enter__(self):
        import importlib

        from autopar.runtime.memory_probe import _Mode

        def wrap(fn):
            def inner(*args, **kwargs):
                with _Mode(self.probe):
                    return fn(*args, **kwargs)
            return inner

        for path, names in KERNEL_BODIES.items():
            module = importlib.import_module(path)
            missing = [n for n in names if not hasattr(module, n)]
            if missing:
                raise RuntimeError(f"memory_model: {path} has no {missing}: update KERNEL_BODIES to its kernel bodies")
            for n in names:
                self.saved.append((module, n, getattr(module, n)))
                setattr(module, n, wrap(getattr(module, n)))
        return self

    def __exit__(self, *exc):
        for module, n, fn in reversed(self.saved):
            setattr(module, n, fn)
        self.saved = []


def _rank_main(rank, world, cfg):
    import functools
    import warnings

    import torch

    import autopar
    from autopar.runtime.memory_probe import PeakTensorMemory, storage_bytes

    warnings.filterwarnings("ignore", category=FutureWarning)  # gloo's *_tensor collectives (ZeRO-1)
    torch.set_num_threads(1)
    mk = cfg["model_kwargs"]
    results = []
    for plan, mp in zip(cfg["plans"], cfg["bf16"]):
        model, inputs, target, loss_fn = make_model(mk, plan.ep > 1)
        kw = {"mixed_precision": autopar.MixedPrecision(param_dtype=torch.bfloat16)} if mp else {}
        pm = autopar.parallelize(model, inputs, loss_fn=gpt_loss32 if mp else loss_fn,
                                 optimizer=functools.partial(torch.optim.AdamW, lr=1e-4),
                                 plan=plan, example_target=target, **kw)
        pm.step(inputs, target)  # step 1: AdamW creates its states
        state = state_tensors(pm)
        base = _categorized_bytes(state)
        base["masters"] = storage_bytes(master_tensors(pm))
        mine = {t.untyped_storage()._cdata for t in state["weights"] + master_tensors(pm) if not t.is_meta}
        unused = storage_bytes([p for p in model.parameters() if p.untyped_storage()._cdata not in mine])
        del state, mine
        gc.collect()
        # the baseline list is built inline: the probe drops it on entry, so no reference here
        # keeps step 1's gradients alive after the step sets them to None
        probe = PeakTensorMemory([t for ts in state_tensors(pm).values() for t in ts])
        with probe, probe_inside_kernels(probe):
            pm.step(inputs, target)
        results.append({"peak": probe.peak_bytes, "baseline": probe.baseline_bytes, "base": base,
                        "unused_model_copy": unused, "stages": list(pm.built.executor.my_stages),
                        "storages": probe.counted_storages,
                        "moe_receive_ratio": pm.metrics.get("moe_receive_ratio")})
        del pm, model
        gc.collect()
    return results


# ------------------------------------------------------------------------------------------------


def _parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_args(ap)
    ap.add_argument("--plans", default=DEFAULT_PLANS, help="comma-separated schedule:m[:pp=P:dp=D:ep=E:zero=Z]")
    ap.add_argument("--deadline", type=float, default=600.0, help="seconds before the parent kills the ranks")
    ap.add_argument("--bf16-profile", choices=("planner", "copy"), default="planner",
                    help="how bf16 plans are profiled: as the planner does (param_dtype=bf16, fake tensors), or a "
                         "real bf16 copy of the model (keeps tied parameters tied)")
    return ap.parse_args(argv)


def _mib(x: float) -> str:
    return f"{x / MiB:.2f}"


def main(argv=None) -> int:
    args = _parse(argv)
    import torch

    torch.set_num_threads(1)
    mk = model_kwargs(args)
    specs = parse_plans(args.plans)
    print(f"memory_model: gpt {args.layers} layers, d_model {args.d_model}, seq {args.seq}, global batch "
          f"{args.batch}, AdamW (fp32 plans; 'bf16' plans: bf16 compute copies, fp32 masters, gradients and "
          f"AdamW states), 2 gloo ranks, torch {torch.__version__}", flush=True)
    print("measured = peak of live tensor bytes during the SECOND step (runtime.memory_probe.PeakTensorMemory: "
          "this rank's parameters + gradients + AdamW states (+ fp32 masters) at entry, plus every storage an ATen op "
          "creates, minus each one freed; allocator slack, gloo buffers and the unused copy of the other rank's "
          "weights are not counted)", flush=True)
    from autopar.planner.estimate import DEFAULT_MOE_IMBALANCE

    priced, _ev, _prof = profile_and_price(mk, specs, bf16_profile=args.bf16_profile)
    t0 = time.perf_counter()
    ranks = run_ranks(_rank_main, 2, dict(model_kwargs=mk, plans=[p for _s, _c, p in priced],
                                          bf16=[bool(s["bf16"]) for s, _c, _p in priced]), deadline_s=args.deadline)
    print(f"ran {len(priced)} plans x 2 steps on 2 ranks in {time.perf_counter() - t0:.1f} s", flush=True)
    worst_over, worst_under, ok = 0.0, 0.0, True
    for k, (spec, cand, plan) in enumerate(priced):
        est = cand.estimate
        print(f"\n[{plan_label(spec)}] stage cuts {list(plan.stage_cuts)}, recompute {list(plan.recompute) or 'none'}, "
              f"predicted step {est.step_time * 1e3:.1f} ms")
        if spec["ep"] > 1:
            ratios = [ranks[r][k]["moe_receive_ratio"] for r in range(2)]
            print(f"  llama with dropless MoE ({MOE_EXPERTS} experts, top {MOE_TOP_K}); predicted at moe_imbalance "
                  f"{DEFAULT_MOE_IMBALANCE:g} (the default); measured max/mean receive of one dispatch (pm.metrics "
                  f"moe_receive_ratio): rank 0 {ratios[0]:.3f}, rank 1 {ratios[1]:.3f}")
        print(f"  {'rank':>4}  {'predicted MiB':>13}  {'measured MiB':>12}  {'error':>7}  "
              f"{'meas. baseline':>14}  {'meas. above':>11}  {'pred. static':>12}  {'pred. above':>11}")
        for r in range(2):
            m = ranks[r][k]
            pred = est.peak_memory[r % spec["pp"]]  # global rank = dp_rank * pp + pp_rank
            row = est.memory[r % spec["pp"]]
            err = (pred - m["peak"]) / m["peak"]
            worst_over, worst_under = max(worst_over, err), min(worst_under, err)
            good = abs(err) <= MAX_ERROR and err >= -MAX_UNDER
            ok &= good
            static = row["weights"] + row["gradients"] + row["optimizer"]
            print(f"  {r:>4}  {_mib(pred):>13}  {_mib(m['peak']):>12}  {err * 100:>+6.1f}%  "
                  f"{_mib(m['baseline']):>14}  {_mib(m['peak'] - m['baseline']):>11}  {_mib(static):>12}  "
                  f"{_mib(pred - static):>11}  {'ok' if good else 'MISS'}")
        for r in range(2):
            row = est.memory[r % spec["pp"]]
            parts = ", ".join(f"{name} {_mib(v)}" for name, v in row.items() if v)
            b = ranks[r][k]["base"]
            print(f"  rank {r} predicted (MiB): {parts}")
            gather = f", zero-3 gather {_mib(b['zero-3 gather'])}" if b["zero-3 gather"] else ""
            print(f"  rank {r} measured at entry (MiB): weights {_mib(b['weights'])}, "
                  f"gradients {_mib(b['gradients'])}, "
                  f"optimizer {_mib(b['optimizer'])}{gather}; stages {ranks[r][k]['stages']}; unused model copy "
                  f"{_mib(ranks[r][k]['unused_model_copy'])} (not counted)")
            if spec["bf16"]:
                where, adam = ("weights", b["optimizer"]) if spec["zero"] == 3 else \
                    ("optimizer", b["optimizer"] - b["masters"])
                print(f"  rank {r} mixed precision at entry (MiB): fp32 masters {_mib(b['masters'])} (counted in "
                      f"{where}), AdamW states {_mib(adam)}, bf16 compute copies "
                      f"{_mib(b['weights'] - (b['masters'] if spec['zero'] == 3 else 0))} (weights), fp32 gradient "
                      f"accumulators {_mib(b['gradients'])}")
    print(f"\nworst over-prediction {worst_over * 100:+.1f}%, worst under-prediction "
          f"{'none' if worst_under >= 0 else f'{worst_under * 100:+.1f}%'}")
    print(f"P3 memory model: {'PASS' if ok else 'FAIL'} (target: every |error| <= {MAX_ERROR * 100:.0f}% and "
          f"never under-predicting by more than {MAX_UNDER * 100:.0f}%)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
