"""L6: a GPT too big for one process under a per-process memory cap, trained as pp=4 from a
safetensors file, per-rank peak memory against the planner's prediction.

    python benchmarks/large_model.py            # ~4-5 min: 16 layers, d_model 1536, vocab 8192 (0.47 B
                                                # parameters, 6.95 GiB of fp32 weights + grads + AdamW), cap 5 GiB
    python benchmarks/large_model.py --layers 2 --d-model 64 --heads 2 --vocab 256 --seq 16 --cap-gib 1   # tiny

What it does, in order:

1. **checkpoint.** The GPT (``autopar.examples.gpt``) is built on the meta device. Every tensor
   gets the values of autopar's plan-independent init (``runtime/materialize.InitValues``: what
   ``parallelize(..., seed=0)`` without weights would give it), computed and written ONE
   TENSOR AT A TIME into a safetensors file whose header is written first from the shapes (the
   tied LM head is stored once, as ``wte.weight``). The writer never holds more than one
   tensor: no whole fp32 model, no copy of it.
2. **planner, one process.** ``autopar.planner.plan_model(meta model, gpus=1,
   memory_limit=cap)`` on the measured ``cpu`` device profile: it finds no plan and says why
   (its report is printed). Nothing in ``autopar/build.py`` changes: ``parallelize`` without a
   plan would plan against the host's memory divided by LOCAL_WORLD_SIZE, not a cap.
3. **planner, pp=4.** The same profile priced as pp=4 (``search.price``: balanced stages, then
   the stage-boundary ILP), with the cap as the memory limit; ``search.to_plan`` gives the
   ``autopar.Plan`` that runs, so the prediction is for the stage cuts that run.
4. **one process under the cap** (unless ``--skip-single-run``): ``parallelize`` with
   ``Plan(pp=1)`` and the same weights in one process whose data segment is capped, then a
   step. It stops with the allocator's out-of-memory error, reported as such.
5. **pp=4 under the cap.** 4 gloo processes (spawned, one thread each), each capped, each
   builds the meta model, ``parallelize(..., weights=<file>, plan=<the planner's pp=4 plan>)``
   (each materializes and reads only its stages' tensors), and trains ``--steps`` AdamW steps.

**The cap** is ``resource.setrlimit(RLIMIT_DATA, cap)`` (the soft limit, the one enforced) in each
process, set after torch is imported and the process group is up, before the model is built,
and restored when the rank's work returns. RLIMIT_DATA limits the
process's private writable mappings (heap, anonymous mmap: every tensor torch allocates on
CPU); past it, torch's CPU allocator raises ``RuntimeError: DefaultCPUAllocator: can't allocate
memory``. RLIMIT_AS is not used: it counts every reserved address range (a torch process with
a gloo group maps ~600 MB of address space for ~220 MB resident, plus 8 MB per thread stack),
so a cap set with it says little about memory. Both count safetensors' memory map of the
WHOLE checkpoint file in every process (a private, copy-on-write mapping; on this box a 1 GiB
file adds 1 GiB to VmData at ``safe_open``, with nothing resident): a pp rank's data segment is
the whole file + its gradients and AdamW states + activations, which the default sizes leave
room for (printed per rank).

**Measured per rank**: ``VmRSS`` when the rank starts ("cold": after ``import torch`` and the
gloo group), ``VmRSS`` after the capture machinery is loaded ("warm": ``warm_runtime``, the
planner's profiler run once on a 1-layer toy GPT: torch.export, make_fx, fake tensors, sympy;
about +0.11 GiB whatever the model), the peak RSS over the whole run (``VmHWM``: building,
loading, every step; the optimizer writes the loaded weights in place, so their file-backed
pages become the process's own copy-on-write pages once: no double count after the first
step), the resident parameter bytes (``autopar.inspect.resident_parameter_bytes``) and the peak
of live tensor bytes during the last step (``runtime.memory_probe.PeakTensorMemory``, the
quantity the planner models, as in benchmarks/memory_model.py). ``--malloc-mmap-threshold``
runs the ranks with glibc's ``MALLOC_MMAP_THRESHOLD_`` fixed (freed tensors go back to the
system instead of staying in the heap; see benchmarks/README.md).

**Predicted per rank**: ``Estimate.peak_memory`` of the pp=4 candidate: weights, gradients,
AdamW states, activations at the schedule's peak, one unit's working set, P2P buffers (the
``cpu`` profile counts live tensor bytes: its runtime overhead is 0).

**Target** (issue 13 L6, P3's bounds): (predicted - measured) / measured within 15%, never below
-5%, judged on the peak RSS MINUS the rank's WARM starting RSS: the planner's ``cpu`` profile
models tensor memory and adds no runtime overhead (``estimate.runtime_overhead`` is 0 on cpu),
and the warm start (~0.33 GiB: interpreter, torch, gloo and the capture machinery, the same in
every process and independent of the model) is exactly that runtime. The errors against peak
RSS minus the cold start and against the whole peak RSS are printed beside it. Exit code 0 when
the run completed (PASS/FAIL is printed); 1 when a step of it failed unexpectedly.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import shutil
import struct
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
os.environ.setdefault("OMP_NUM_THREADS", "1")

from autopar.runtime.spawn import run_ranks  # noqa: E402

MAX_ERROR = 0.15
MAX_UNDER = 0.05
GiB = 2 ** 30
MiB = 2 ** 20


def _parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--d-model", type=int, default=1536)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4, help="global batch")
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--schedule", default="1f1b")
    ap.add_argument("--pp", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--cap-gib", type=float, default=5.0, help="per-process memory cap (RLIMIT_DATA), GiB")
    ap.add_argument("--workdir", default=None, help="where the safetensors file goes (default: a temp dir, removed)")
    ap.add_argument("--skip-single-run", action="store_true", help="skip the real one-process run under the cap")
    ap.add_argument("--deadline", type=float, default=900.0, help="seconds before the parent kills the ranks")
    ap.add_argument("--malloc-mmap-threshold", type=int, default=None, metavar="BYTES",
                    help="run the ranks with MALLOC_MMAP_THRESHOLD_=BYTES (glibc: every allocation from that size is "
                         "its own mapping, returned to the system when freed; default: glibc's dynamic threshold)")
    return ap.parse_args(argv)


def _config(args):
    from autopar.examples.gpt import GPTConfig

    return GPTConfig(vocab_size=args.vocab, seq_len=args.seq, n_layer=args.layers, n_head=args.heads,
                     d_model=args.d_model)


def meta_model(cfg):
    import torch

    from autopar.examples.gpt import GPT

    with torch.device("meta"):
        return GPT(cfg)


def batch(cfg, size: int):
    """One global batch of token ids (the same on every rank) and its next-token targets."""
    import torch

    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.vocab_size, (size, cfg.seq_len + 1), generator=gen)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def proc_status() -> dict:
    """This process's memory counters from /proc/self/status, in bytes."""
    out = {}
    with open("/proc/self/status") as fh:
        for line in fh:
            key, _, val = line.partition(":")
            if key in ("VmPeak", "VmSize", "VmHWM", "VmRSS", "RssAnon", "RssFile", "VmData"):
                out[key] = int(val.split()[0]) * 1024
    return out


def warm_runtime() -> None:
    """Load what building a model loads before any of it exists: the planner's profiler run on a
    1-layer toy GPT (fake tensors; torch.export, make_fx, the fake-tensor and sympy machinery,
    ~120 MB of RSS on this box), then dropped. Nothing of the real model is touched."""
    import gc

    from autopar.examples.gpt import GPTConfig, gpt_loss
    from autopar.planner.profile import profile_model

    toy = GPTConfig(vocab_size=64, seq_len=8, n_layer=1, n_head=2, d_model=32)
    idx, target = batch(toy, 2)
    profile_model(meta_model(toy), (idx,), target, gpt_loss)
    gc.collect()


@contextlib.contextmanager
def memory_cap(cap_bytes: int):
    """RLIMIT_DATA's soft limit (the one the kernel enforces) at ``cap_bytes`` inside, the previous
    limits after: a process that runs several jobs in turn (a pool of ranks) is not left capped."""
    import resource

    old = resource.getrlimit(resource.RLIMIT_DATA)
    cap = int(cap_bytes) if old[1] == resource.RLIM_INFINITY else min(int(cap_bytes), old[1])
    resource.setrlimit(resource.RLIMIT_DATA, (cap, old[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_DATA, old)


# ------------------------------------------------------------------------------------------------
# 1. the checkpoint, one tensor at a time


def write_checkpoint(cfg, path: str, seed: int = 0, say=print) -> dict:
    """Write the init of the meta GPT to ``path`` (safetensors) one tensor at a time; returns
    {"bytes", "tensors", "params"}."""
    import torch

    from autopar.runtime.materialize import InitValues

    model = meta_model(cfg)
    # canonical FQN -> tensor: every parameter and buffer once (the tied head under its first name, wte.weight)
    tensors = dict(model.named_parameters()) | dict(model.named_buffers())
    shapes = {f: tuple(t.shape) for f, t in model.state_dict(keep_vars=True).items()}
    dtypes = {f: t.dtype for f, t in model.state_dict(keep_vars=True).items()}
    init = InitValues(model, seed, None, shapes, dtypes)
    names = [f for f, t in tensors.items() if t.dtype == torch.float32]
    assert len(names) == len(tensors), "examples/gpt is all fp32"
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for f in names:
        nbytes = 4 * tensors[f].numel()
        header[f] = {"dtype": "F32", "shape": list(shapes[f]), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned
    rss0 = proc_status()["VmRSS"]
    peak = 0
    t0 = time.perf_counter()
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(blob)))
        fh.write(blob)
        for f in names:
            t = init.get([f])[f].contiguous()
            fh.write(t.numpy().data)
            peak = max(peak, proc_status()["VmRSS"] - rss0)
            del t
    say(f"checkpoint: {len(names)} tensors, {offset / GiB:.2f} GiB of fp32 written to {path} in "
        f"{time.perf_counter() - t0:.1f} s, one tensor at a time (writer's RSS at most {peak / MiB:.0f} MiB above "
        f"its start; largest tensor {max(4 * tensors[f].numel() for f in names) / MiB:.0f} MiB)")
    return {"bytes": offset, "tensors": len(names), "params": sum(tensors[f].numel() for f in names)}


# ------------------------------------------------------------------------------------------------
# 2./3. the planner


def plan_and_price(args, cfg, cap: float, say=print):
    """(one-process report text or None if a plan fits, pp candidate, its autopar.Plan, profile)."""
    from autopar.examples.gpt import gpt_loss
    from autopar.planner import plan_model
    from autopar.planner.devices import get_profile
    from autopar.planner.estimate import Evaluator, Layout
    from autopar.planner.report import text as report_text
    from autopar.planner.search import price, to_plan

    device = get_profile("cpu")
    model = meta_model(cfg)
    idx, target = batch(cfg, args.batch)
    b = args.batch // args.microbatches
    t0 = time.perf_counter()
    res, info = plan_model(model, (idx[:b],), target[:b], gpt_loss, gpus=1, global_batch=args.batch, device=device,
                           memory_limit=cap, allow_cp=False, allow_ep=False, name="gpt")
    say(f"planner (1 process, memory limit = the cap, {cap / GiB:.2f} GiB, cpu profile: {device.source}) in "
        f"{time.perf_counter() - t0:.1f} s:")
    single = None if res.chosen is not None else report_text(res, info)
    actual = sum(p.numel() for p in model.parameters())
    if res.evaluator.profile.total_params != actual:
        say(f"  NOTE: the planner's profile counts {res.evaluator.profile.total_params} parameters, the model has "
            f"{actual}: the profile of a meta model lost the tie of wte.weight and lm_head.weight (a rank holding "
            "both counts it twice; each pp rank here holds one of them, so the pp prediction is not affected)")
    if res.chosen is not None:
        say(f"  UNEXPECTED: a one-process plan fits: {res.chosen.layout.label()}, peak "
            f"{max(res.chosen.estimate.peak_memory) / GiB:.2f} GiB")
    ev = Evaluator(res.evaluator.profile, device, cap, args.batch)
    lay = Layout(pp=args.pp, dp=1, cp=1, ep=1, schedule=args.schedule, v=1, m=args.microbatches, b=b, zero=0)
    cand = price(ev, lay)
    return single, cand, to_plan(ev, cand), res.evaluator.profile


# ------------------------------------------------------------------------------------------------
# 4./5. the runs


def _build(cfg, gcfg, plan):
    import torch

    import autopar
    from autopar.examples.gpt import gpt_loss

    model = meta_model(gcfg)
    idx, target = batch(gcfg, cfg["batch"])
    pm = autopar.parallelize(model, (idx,), loss_fn=gpt_loss, optimizer=functools.partial(torch.optim.AdamW, lr=1e-4),
                             plan=plan, example_target=target, weights=cfg["weights"], seed=0)
    return pm, idx, target


def _single_rank(rank, world, cfg, gcfg):
    """One process under the cap: parallelize with Plan(pp=1), then steps; the error it stops with."""
    import autopar

    start = proc_status()
    phase = "parallelize"
    with memory_cap(cfg["cap"]):
        try:
            pm, idx, target = _build(cfg, gcfg, autopar.Plan(pp=1, num_microbatches=cfg["microbatches"]))
            for step in range(cfg["steps"]):
                phase = f"step {step + 1}"
                pm.step(idx, target)
        except (RuntimeError, MemoryError) as e:
            return {"error": f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300]}", "phase": phase,
                    "start": start, "end": proc_status()}
        return {"error": None, "phase": "done", "start": start, "end": proc_status()}


def _train_rank(rank, world, cfg, gcfg, plan):
    start = proc_status()  # the runtime: interpreter, torch, gloo; nothing of the model yet
    warm_runtime()
    warm = proc_status()   # ... and the capture machinery loaded
    with memory_cap(cfg["cap"]):
        return _train_capped(cfg, gcfg, plan, start, warm)


def _train_capped(cfg, gcfg, plan, start, warm):
    from autopar.inspect import resident_parameter_bytes
    from autopar.runtime.memory_probe import PeakTensorMemory
    from benchmarks.memory_model import state_tensors

    t0 = time.perf_counter()
    pm, idx, target = _build(cfg, gcfg, plan)
    built = {"build_s": time.perf_counter() - t0, "after_build": proc_status(),
             "resident": resident_parameter_bytes(pm), "stages": list(pm.built.executor.my_stages)}
    losses, times, live = [], [], None
    for step in range(cfg["steps"]):
        t0 = time.perf_counter()
        if step == cfg["steps"] - 1 and step > 0:  # the last step under the live-tensor probe
            probe = PeakTensorMemory([t for ts in state_tensors(pm).values() for t in ts])
            with probe:
                loss = pm.step(idx, target)
            live = probe.peak_bytes
        else:
            loss = pm.step(idx, target)
        times.append(time.perf_counter() - t0)
        losses.append(float(loss))
    return {"start": start, "warm": warm, "end": proc_status(), "losses": losses, "step_s": times, "live_peak": live,
            **built}


# ------------------------------------------------------------------------------------------------


def _gib(x: float) -> str:
    return f"{x / GiB:.3f}"


def main(argv=None) -> int:
    args = _parse(argv)
    import torch

    torch.set_num_threads(1)
    cfg = _config(args)
    cap = int(args.cap_gib * GiB)
    n = 12 * cfg.n_layer * cfg.d_model ** 2 + 13 * cfg.n_layer * cfg.d_model + (cfg.vocab_size + cfg.seq_len + 2) \
        * cfg.d_model
    print(f"large_model: gpt {cfg.n_layer} layers, d_model {cfg.d_model}, {cfg.n_head} heads, vocab {cfg.vocab_size}, "
          f"seq {cfg.seq_len}, global batch {args.batch}, {n / 1e9:.3f} B parameters: fp32 weights + gradients + "
          f"AdamW states {16 * n / GiB:.2f} GiB in one process; cap {args.cap_gib:g} GiB per process (RLIMIT_DATA); "
          f"{args.pp} gloo ranks, {args.schedule}, {args.microbatches} microbatches; torch {torch.__version__}",
          flush=True)
    work = args.workdir or tempfile.mkdtemp(prefix="autopar-large-")
    os.makedirs(work, exist_ok=True)
    path = os.path.join(work, "model.safetensors")
    t_all = time.perf_counter()
    try:
        write_checkpoint(cfg, path, say=lambda m: print(m, flush=True))
        single_report, cand, plan, _prof = plan_and_price(args, cfg, cap, say=lambda m: print(m, flush=True))
        if single_report is not None:
            print("\n".join("  | " + line for line in single_report.splitlines()))
        est = cand.estimate
        print(f"planner (pp={args.pp}): stage cuts {list(plan.stage_cuts)}, predicted peak per rank "
              f"{', '.join(_gib(x) for x in est.peak_memory)} GiB (limit {_gib(cap)}): "
              f"{'fits' if est.feasible else 'DOES NOT FIT'}", flush=True)
        rcfg = {"weights": path, "cap": cap, "batch": args.batch, "microbatches": args.microbatches,
                "steps": args.steps}
        if args.malloc_mmap_threshold is not None:  # read by glibc when a spawned rank starts
            os.environ["MALLOC_MMAP_THRESHOLD_"] = str(args.malloc_mmap_threshold)
            print(f"ranks run with MALLOC_MMAP_THRESHOLD_={args.malloc_mmap_threshold}", flush=True)
        single = None
        if not args.skip_single_run:
            t0 = time.perf_counter()
            single = run_ranks(_single_rank, 1, rcfg, cfg, deadline_s=args.deadline, timeout_s=60.0)[0]
            where = f"in {single['phase']}" if single["error"] else "completed"
            print(f"\none process under the cap ({time.perf_counter() - t0:.1f} s): {where}; "
                  f"{single['error'] or 'no error'}; peak RSS {_gib(single['end']['VmHWM'])} GiB, data segment "
                  f"{_gib(single['end']['VmData'])} GiB at the end", flush=True)
        t0 = time.perf_counter()
        ranks = run_ranks(_train_rank, args.pp, rcfg, cfg, plan, deadline_s=args.deadline, timeout_s=120.0)
        print(f"\npp={args.pp} under the cap: {args.steps} steps in {time.perf_counter() - t0:.1f} s (spawn, build, "
              f"load, train); losses {', '.join(f'{x:.4f}' for x in ranks[-1]['losses'])}; step times rank 0 "
              f"{', '.join(f'{x:.1f}' for x in ranks[0]['step_s'])} s", flush=True)
    except AssertionError as e:  # run_ranks: a rank failed or hung
        print(f"\nFAILED: {e}", flush=True)
        return 1
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    print("\nper rank, GiB; error = (predicted - measured) / measured, judged on peak RSS minus the warm start RSS "
          "(see the docstring); beside it the same against peak RSS minus the cold start RSS and against the whole "
          "peak RSS, and the planner against the live-tensor peak of the last step")
    print(f"  {'rank':>4}  {'stages':>6}  {'predicted':>9}  {'cold start':>10}  {'warm start':>10}  {'peak RSS':>8}  "
          f"{'peak-warm':>9}  {'error':>7}  {'vs cold':>7}  {'raw':>7}  {'live peak':>9}  {'vs live':>7}  "
          f"{'data seg.':>9}")
    ok, errors = True, []
    for r, m in enumerate(ranks):
        pred = est.peak_memory[r]
        peak, cold, warm = m["end"]["VmHWM"], m["start"]["VmRSS"], m["warm"]["VmRSS"]
        err = (pred - (peak - warm)) / (peak - warm)
        good = abs(err) <= MAX_ERROR and err >= -MAX_UNDER
        ok &= good
        errors.append(err)
        live = m["live_peak"]
        vs_cold, raw = (pred - (peak - cold)) / (peak - cold), (pred - peak) / peak
        vs_live = _pct((pred - live) / live) if live else "-"
        print(f"  {r:>4}  {','.join(map(str, m['stages'])):>6}  {_gib(pred):>9}  {_gib(cold):>10}  {_gib(warm):>10}  "
              f"{_gib(peak):>8}  {_gib(peak - warm):>9}  {_pct(err):>7}  {_pct(vs_cold):>7}  {_pct(raw):>7}  "
              f"{_gib(live or 0):>9}  {vs_live:>7}  {_gib(m['end']['VmData']):>9}  {'ok' if good else 'MISS'}")
    for r, m in enumerate(ranks):
        row = est.memory[r]
        print(f"  rank {r} predicted (GiB): " + ", ".join(f"{k} {_gib(v)}" for k, v in row.items() if v))
        print(f"  rank {r} measured (GiB): RSS cold {_gib(m['start']['VmRSS'])}, warm {_gib(m['warm']['VmRSS'])}, "
              f"after parallelize {_gib(m['after_build']['VmRSS'])} (built and loaded in {m['build_s']:.1f} s; the "
              f"loaded weights are paged in on first use), peak {_gib(m['end']['VmHWM'])}; resident parameters "
              f"{_gib(m['resident'])}; live tensors at the last step's peak {_gib(m['live_peak'] or 0)}; peak RSS - "
              f"warm start - live peak = {_gib(m['end']['VmHWM'] - m['warm']['VmRSS'] - (m['live_peak'] or 0))} "
              "(allocator slack, gloo, graphs)")
    refused = single_report is not None
    stopped = single is not None and single["error"] is not None
    print(f"\none process under the cap: the planner finds no plan: {'yes' if refused else 'NO'}; the real run "
          f"stops with the allocator's out-of-memory error: "
          f"{'skipped' if single is None else 'yes' if stopped else 'NO'}")
    print(f"per-rank memory (predicted vs peak RSS - warm start RSS; within {MAX_ERROR * 100:.0f}%, never under by "
          f"more than {MAX_UNDER * 100:.0f}%): {'met' if ok else 'NOT met'} (errors from {_pct(min(errors))} to "
          f"{_pct(max(errors))})")
    verdict = "PASS" if ok and refused and (single is None or stopped) else "FAIL"
    print(f"L6 large model: {verdict}; total {time.perf_counter() - t_all:.0f} s", flush=True)
    return 0


def _pct(x: float) -> str:
    return f"{x * 100:+.1f}%"


if __name__ == "__main__":
    sys.exit(main())
