"""A5: cost of autopar's graph-level backward split on one middle pipeline stage (CPU).

The example GPT is built with ``layers + 2`` blocks and cut at block boundaries into three
stages so that stage 1 is exactly ``blocks[1 : layers + 1]``: a true middle stage whose input
(the residual stream) needs a gradient and whose output receives one. On that stage we time
one iteration (forward + full backward) of

  ours(F+I+W)    the stage's F, I and W programs from split_backward, called as runtime/local.py calls them
  ours(F+B)      F and the fused B program (I and W in one graph)
  eager          the same blocks as an nn.Module: forward, torch.autograd.backward(out, grad)
  torch(F+I+W)   torch.distributed.pipelining's split backward, called as PipelineStage does:
                 forward eagerly, stage_backward_input(...), then stage_backward_weight(...)
  ours(F+I+W),again     an A/A control: ours once more. Its ratio to ours is the noise
                 floor of this run (same code; anything but 1.00 is the machine)

with the same input activation, upstream gradient and parameters for all. Before timing, the
input gradient and every weight gradient of the variants are compared (rel 1e-5). Timing:
warm-up, then ``--reps`` rounds, each running every variant once in a rotated order (ABCD,
BCDA, ...) so machine noise hits all variants alike. Times are this thread's CPU time (with
one intra-op thread that is the work done) and wall-clock time. The targets are judged on the
median over rounds of the per-round ratio of CPU times: the variants of one round run within
a second of each other, so the slow drift of a shared machine cancels in it, while a ratio of
two medians taken over different moments does not (it is printed beside, with the ratio of
the best-of times).

    python benchmarks/split_backward.py [--layers 4 --d-model 256 --heads 8 --seq 128 --batch 4 --reps 41]

Targets (design.md section 6, last paragraph): ours/eager <= 1.05, ours/torch <= 0.95.
"""
from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time

import torch
import torch.nn as nn

from autopar.passes import keys
from autopar.runtime.execute import run

TARGET_VS_EAGER = 1.05
TARGET_VS_TORCH = 0.95
RTOL = 1e-5


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4, help="transformer blocks in the timed middle stage")
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--reps", type=int, default=41, help="timed rounds (each runs every variant once)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads (keep 1 on a shared 2-core box)")
    ap.add_argument("--profile", action="store_true", help="also print a torch.profiler op table per variant")
    return ap.parse_args(argv)


# ---------------------------------------------------------------------------------------------
# building the stage


def build_middle_stage(args):
    """Capture the GPT, cut so that stage 1 is blocks[1 : layers+1], split its backward."""
    from autopar.examples.gpt import make_gpt
    from autopar.passes import capture, split_backward, split_stages
    from autopar.passes.split_stages import block_key

    L = args.layers
    model, inputs, target, loss_fn = make_gpt(n_layer=L + 2, d_model=args.d_model, n_head=args.heads,
                                              seq_len=args.seq, batch_size=args.batch, seed=0)
    t0 = time.perf_counter()
    cap = capture(model, inputs, target, loss_fn)
    order = [n for n in cap.gm.graph.nodes if n.op in ("call_function", "get_attr")]
    blocks_at, prev = [], None
    for n in order:
        k = block_key(n)
        prev = prev if k is ... else k
        blocks_at.append(prev)

    # block_key yields the export path ("model.blocks.3"); match on the tail so either spelling works
    def first(i):
        return next(j for j, k in enumerate(blocks_at)
                    if k is not None and (k == f"blocks.{i}" or k.endswith(f".blocks.{i}")))

    cuts = [first(1), first(L + 1)]
    stages = split_stages(cap, 3, cuts=cuts)
    st = stages[1]
    assert len(st.inputs) == 1 and len(st.outputs) == 1, (st.inputs, st.outputs)
    prog = split_backward(st, {name: True for name in st.inputs})
    assert prog.grad_inputs == st.inputs and prog.diff_outputs == st.outputs, (prog.grad_inputs, prog.diff_outputs)
    t_build = time.perf_counter() - t0
    blocks = nn.Sequential(*model.blocks[1: L + 1])
    fqns = {f"blocks.{i + 1}.{n}" for i, m in enumerate(blocks) for n, _ in m.named_parameters()}
    assert fqns == set(prog.grad_params), (sorted(fqns ^ set(prog.grad_params)))
    return model, st, prog, blocks, t_build


# ---------------------------------------------------------------------------------------------
# the variants; each returns (input grad, {fqn: weight grad}) and leaves no state behind


class Variants:
    def __init__(self, model, st, prog, blocks, x, g):
        self.st, self.prog, self.blocks = st, prog, blocks
        self.in_name, self.out_name = st.inputs[0], st.outputs[0]
        self.state = keys.state(dict(model.named_parameters()), dict(model.named_buffers()), {})
        strides = prog.input_strides[self.in_name]
        x_in = x if x.stride() == strides else torch.empty_strided(x.shape, strides, dtype=x.dtype).copy_(x)
        self.x_ours, self.x, self.g = x_in, x, g
        self.weights = list(blocks.parameters())
        self.fqns = [f"blocks.{i + 1}.{n}" for i, m in enumerate(blocks) for n, _ in m.named_parameters()]

    # ours ------------------------------------------------------------------------------------
    def ours_fiw(self):
        p, env = self.prog, {keys.input(self.in_name): self.x_ours}
        run(p.f, env, self.state, keep=p.keys_after("F"))  # as StageWork: a program frees what it read last
        env[keys.grad(self.out_name)] = self.g
        run(p.i, env, self.state, keep=p.keys_after("I"))
        run(p.w, env, self.state, keep=frozenset())
        return env[keys.gin(self.in_name)], {f: env[keys.gparam(f)] for f in p.grad_params}

    def ours_fb(self):
        p, env = self.prog, {keys.input(self.in_name): self.x_ours}
        run(p.f, env, self.state, keep=p.keys_after("F"))
        env[keys.grad(self.out_name)] = self.g
        run(p.b, env, self.state, keep=frozenset())
        return env[keys.gin(self.in_name)], {f: env[keys.gparam(f)] for f in p.grad_params}

    # eager -----------------------------------------------------------------------------------
    def _zero(self):
        for w in self.weights:
            w.grad = None

    def _collect(self, xin):
        grads = {f: w.grad for f, w in zip(self.fqns, self.weights)}
        self._zero()
        return xin.grad, grads

    def eager(self):
        xin = self.x.detach().requires_grad_(True)
        out = self.blocks(xin)
        torch.autograd.backward(out, self.g)
        return self._collect(xin)

    # torch.distributed.pipelining --------------------------------------------------------------
    def torch_fiw(self):
        from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

        xin = self.x.detach().requires_grad_(True)
        out = self.blocks(xin)  # PipelineStage.forward_one_chunk: plain eager forward
        # PipelineStage.backward_one_chunk(full_backward=False) on a non-first stage:
        _dinputs, param_groups = stage_backward_input((out,), (self.g,), (xin,), self.blocks.parameters())
        # PipelineStage.backward_weight_one_chunk on a non-first stage:
        stage_backward_weight(self.blocks.parameters(), param_groups)
        return self._collect(xin)

    def ours_fiw_again(self):
        """A/A control: the same call as ours_fiw, timed as a separate variant."""
        return self.ours_fiw()

    def table(self, diagnostics: bool = True):
        t = {"ours(F+I+W)": self.ours_fiw, "ours(F+B)": self.ours_fb,
             "eager(fwd+bwd)": self.eager, "torch(F+I+W)": self.torch_fiw}
        if diagnostics:
            t["ours(F+I+W),again"] = self.ours_fiw_again
        return t


def check_same(variants: Variants) -> bool:
    """Every variant's input grad and weight grads allclose (rtol 1e-5) to eager's, once, untimed."""
    results = {name: fn() for name, fn in variants.table().items()}
    ref_name = "eager(fwd+bwd)"
    ref_gin, ref_gw = results[ref_name]
    ok = True
    for name, (gin, gw) in results.items():
        if name == ref_name:
            continue
        pairs = [("input", gin, ref_gin)] + [(f, gw.get(f), ref) for f, ref in ref_gw.items()]
        bad = [f for f, a, b in pairs if not _close(a, b)]
        worst_err, worst_name = max((_rel_err(a, b), f) for f, a, b in pairs)
        good = not bad and set(gw) == set(ref_gw)
        ok &= good
        print(f"check {name:>14} vs {ref_name}: input grad + {len(ref_gw)} weight grads allclose(rtol={RTOL:g}): "
              f"{'OK' if good else 'MISMATCH ' + ', '.join(bad[:5])}; "
              f"max |diff|/max|ref| {worst_err:.1e} ({worst_name})")
    return ok


def _close(a, b) -> bool:
    # rtol per element, plus an atol scaled to the tensor so that entries near 0 don't fail on rounding
    return (a is not None and a.shape == b.shape
            and torch.allclose(a, b, rtol=RTOL, atol=RTOL * b.abs().max().item()))


def _rel_err(a, b) -> float:
    if a is None or a.shape != b.shape:
        return float("inf")
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


# ---------------------------------------------------------------------------------------------
# timing


def time_interleaved(fns: dict, reps: int, warmup: int) -> tuple[dict, dict]:
    """Per-variant lists of (wall seconds, this thread's CPU seconds), one entry per round.

    With one intra-op thread every kernel and the CPU autograd engine run on this thread, so its
    CPU time is the work done; wall time also counts time the (shared) machine gave to others.
    """
    names = list(fns)
    for _ in range(warmup):
        for n in names:
            fns[n]()
    wall = {n: [] for n in names}
    cpu = {n: [] for n in names}
    gc.collect()
    gc_was = gc.isenabled()
    gc.disable()
    try:
        for r in range(reps):
            rot = names[r % len(names):] + names[: r % len(names)]  # ABCD, BCDA, ... cancels order effects
            for n in rot:
                c0, t0 = time.thread_time(), time.perf_counter()
                out = fns[n]()
                t1, c1 = time.perf_counter(), time.thread_time()
                del out  # free outside the timed region, like a runtime releasing after use
                wall[n].append(t1 - t0)
                cpu[n].append(c1 - c0)
    finally:
        if gc_was:
            gc.enable()
    return wall, cpu


def profile_variants(fns: dict, rows: int = 15) -> None:
    from torch.profiler import ProfilerActivity, profile

    for name, fn in fns.items():
        fn()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            fn()
        print(f"\n--- torch.profiler: {name} ---")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows))


def phase_times(prog, v: Variants, reps: int) -> dict[str, float]:
    """Median thread-CPU time of ours' F, I and W programs, each timed alone, run in order."""
    out = {"F": [], "I": [], "W": []}
    for _ in range(reps):
        env = {keys.input(v.in_name): v.x_ours}
        c0 = time.thread_time()
        run(prog.f, env, v.state, keep=prog.keys_after("F"))
        c1 = time.thread_time()
        env[keys.grad(v.out_name)] = v.g
        run(prog.i, env, v.state, keep=prog.keys_after("I"))
        c2 = time.thread_time()
        run(prog.w, env, v.state, keep=frozenset())
        c3 = time.thread_time()
        del env
        out["F"].append(c1 - c0)
        out["I"].append(c2 - c1)
        out["W"].append(c3 - c2)
    return {k: statistics.median(t) for k, t in out.items()}


def _verdict(r: float, target: float) -> str:
    return "MET" if r <= target else "NOT MET"


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"split_backward benchmark: middle stage of {args.layers} GPT blocks, d_model={args.d_model}, "
          f"heads={args.heads}, seq={args.seq}, batch={args.batch}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} thread(s)")
    model, st, prog, blocks, t_build = build_middle_stage(args)
    n_ops = "/".join(str(sum(1 for n in q.gm.graph.nodes if n.op == "call_function"))
                     for q in (prog.f, prog.i, prog.w, prog.b))
    print(f"capture + split + split_backward: {t_build:.2f} s; stage 1 input {st.inputs[0]} -> output "
          f"{st.outputs[0]}, {len(prog.grad_params)} parameters; programs F/I/W/B have {n_ops} ops")

    gen = torch.Generator().manual_seed(1234)
    shape = (args.batch, args.seq, args.d_model)
    x = torch.randn(shape, generator=gen)
    g = torch.randn(shape, generator=gen) / (shape[0] * shape[1])
    v = Variants(model, st, prog, blocks, x, g)
    if not check_same(v):
        print("FAIL: the variants disagree; timings would compare different computations")
        return 1
    if args.profile:
        profile_variants(v.table())

    wall, cpu = time_interleaved(v.table(), args.reps, args.warmup)
    med_w = {n: statistics.median(t) for n, t in wall.items()}
    med_c = {n: statistics.median(t) for n, t in cpu.items()}
    phase = phase_times(prog, v, max(3, args.reps // 2))

    print(f"\nper iteration, median of {args.reps} interleaved rounds after {args.warmup} warm-up "
          f"(thread CPU time = work done; wall = also time lost to other processes):")
    for n in med_w:
        print(f"  {n:>20}: cpu {med_c[n] * 1e3:9.2f} ms   wall {med_w[n] * 1e3:9.2f} ms "
              f"(wall min {min(wall[n]) * 1e3:.2f}, max {max(wall[n]) * 1e3:.2f})")
    print("  ours per program (cpu): " + ", ".join(f"{k} {t * 1e3:.2f} ms" for k, t in phase.items()))

    def ratio(a, b):
        """(median of per-round cpu ratios, ratio of cpu medians, ratio of wall medians, ratio of cpu minima)"""
        paired = statistics.median(x / y for x, y in zip(cpu[a], cpu[b]))
        return paired, med_c[a] / med_c[b], med_w[a] / med_w[b], min(cpu[a]) / min(cpu[b])

    ours, eager, tor, fb, again = "ours(F+I+W)", "eager(fwd+bwd)", "torch(F+I+W)", "ours(F+B)", "ours(F+I+W),again"
    print("\nratios: median of per-round ratios of thread CPU time [ratio of CPU medians; of wall medians; "
          "of CPU minima]:")
    for a, b, target in ((ours, eager, TARGET_VS_EAGER), (ours, tor, TARGET_VS_TORCH), (fb, eager, None),
                         (tor, eager, None), (again, ours, None)):
        if a not in cpu or b not in cpu:
            continue
        r, rc, rw, rm = ratio(a, b)
        judged = f"  (target <= {target})  {_verdict(r, target)}" if target else ""
        print(f"{a}/{b} = {r:.3f}{judged}   [{rc:.3f}; wall {rw:.3f}; min {rm:.3f}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
