"""R7: what one GPU can show about the runtime (run it where CUDA is present).

    python benchmarks/gpu_check.py [--trace gpu_trace.json] [--layers 8 --d-model 512 --seq 256 --batch 16]

1. Numerics: examples/gpt in local mode on CUDA (pp=2, zb-h1, 4 microbatches, SGD lr 0.1, TF32
   off), with and without ``local_transfers``, against eager on the same GPU (the same 4
   microbatches accumulated in order, design.md section 5): loss and every parameter after 2
   steps, as max |difference| / max |reference| per tensor.
2. Streams: one local-mode step with ``local_transfers=True`` under torch.profiler. Values
   crossing pipeline ranks are copied on the communication stream (runtime/streams.py, the
   stand-in for P2P on one device). From the trace: the streams the copies ran on, the stream
   the compute kernels ran on, and how many copies overlapped a compute kernel in time.

3. Offload (issue 35 M5): examples/gpt in local mode on CUDA, pp=2 zb-h1 8 microbatches, two
   SGD steps with ``Plan(offload=1.0)`` and without: losses and every parameter bit for bit
   equal; one offloaded step under torch.profiler: the device-to-host and host-to-device
   copies (``Memcpy DtoH`` / ``HtoD``) ran on a stream other than compute, and some overlapped a
   compute kernel; ``pm.metrics["offloaded_bytes"]`` > 0.
4. Chunked loss: the same model with ``Plan(loss_chunk_tokens=...)`` against eager (rtol).

6. NCCL pipeline P2P (issue 48), where the machine has 2 GPUs: examples/gpt at pp=2 on two NCCL
   processes under 1f1b, zbv and dualpipev (4 microbatches, SGD), P2P as NCCL matches it (tags
   0, one two-rank communicator per direction, receives at their lowered places), against eager
   on one GPU: loss and every parameter after 2 steps. With one GPU it says so and is skipped
   (NCCL refuses two ranks on one device).

Prints one line per check and exits 0 when the numbers match and the copies ran on a stream
other than compute, overlapping it.
"""
from __future__ import annotations

import argparse
import copy
import functools
import json
import math
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

LR = 0.1  # SGD: Adam would divide the fp32 noise of exactly-zero gradients (attention's key
#            bias) by itself and compare summation orders rather than the runtime
ATOL = 1e-6  # with rtol: tests/reference.assert_close_state's contract (design.md section 5)


def _parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--trace", default="gpu_trace.json", help="Chrome trace of the profiled step")
    ap.add_argument("--rtol", type=float, default=1e-5, help="relative tolerance against eager (design.md: 1e-5)")
    return ap.parse_args(argv)


def check_numerics(args) -> bool:
    import torch

    import autopar
    from autopar.demo import _eager_losses
    from autopar.examples.gpt import make_gpt

    model, inputs, target, loss_fn = make_gpt(n_layer=4, d_model=128, n_head=4, seq_len=64, batch_size=8, seed=0)
    model, inputs, target = model.cuda(), tuple(x.cuda() for x in inputs), target.cuda()
    ref_model = copy.deepcopy(model)
    # design.md section 5: the same 4 microbatches in order, loss / 4 accumulated, one step
    ref_losses = _eager_losses(ref_model, inputs, target, loss_fn, functools.partial(torch.optim.SGD, lr=LR), 4, 2)
    ref = dict(ref_model.named_parameters())
    ok = True
    for transfers in (False, True):
        m = copy.deepcopy(model)
        pm = autopar.parallelize(m, inputs, loss_fn=loss_fn, optimizer=functools.partial(torch.optim.SGD, lr=LR),
                                 plan=autopar.Plan(pp=2, schedule="zb-h1", num_microbatches=4), example_target=target,
                                 local_transfers=transfers)
        losses = [pm.step(inputs, target).item() for _ in range(2)]
        loss_err = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
        worst, worst_name = 0.0, ""
        for name, p in m.named_parameters():
            e = ref[name]
            # the tests' contract (tests/reference.assert_close_state): |a - e| <= atol + rtol |e|,
            # atol = max(ATOL, rtol max|e|); err is the worst |a - e| / that bound (<= 1 passes)
            bound = max(ATOL, args.rtol * e.abs().max().item()) + args.rtol * e.abs()
            err = ((p - e).abs() / bound).max().item()
            if err > worst:
                worst, worst_name = err, name
        good = loss_err <= args.rtol and worst <= 1.0
        ok &= good
        print(f"numerics local_transfers={transfers}: losses {losses} vs eager {ref_losses}; max rel err loss "
              f"{loss_err:.1e}; parameters: worst |diff| / (atol + rtol |ref|) = {worst:.2f} "
              f"({worst_name}, <= 1 passes); "
              f"{'OK' if good else 'MISMATCH'} (rtol {args.rtol:g})")
    return ok


def check_streams(args) -> bool:
    import torch
    from torch.profiler import ProfilerActivity, profile

    import autopar
    from autopar.examples.gpt import make_gpt

    model, inputs, target, loss_fn = make_gpt(n_layer=args.layers, d_model=args.d_model, n_head=args.heads,
                                              seq_len=args.seq, batch_size=args.batch, seed=0)
    model, inputs, target = model.cuda(), tuple(x.cuda() for x in inputs), target.cuda()
    pm = autopar.parallelize(model, inputs, loss_fn=loss_fn, optimizer=functools.partial(torch.optim.SGD, lr=1e-3),
                             plan=autopar.Plan(pp=2, schedule="zb-h1", num_microbatches=8), example_target=target,
                             local_transfers=True)
    for _ in range(2):
        pm.step(inputs, target)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        pm.step(inputs, target)
        torch.cuda.synchronize()
    prof.export_chrome_trace(args.trace)
    with open(args.trace) as fh:
        events = json.load(fh)["traceEvents"]
    gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
           and "stream" in e.get("args", {})]
    kernel_time: dict[int, float] = {}
    for e in gpu:
        if e["cat"] == "kernel":
            kernel_time[e["args"]["stream"]] = kernel_time.get(e["args"]["stream"], 0.0) + e["dur"]
    compute = max(kernel_time, key=kernel_time.get, default=None)  # where the F/I/W programs' kernels go

    def is_copy(e) -> bool:  # a transfer: a memcpy, or a strided copy kernel, off the compute stream
        return e["args"]["stream"] != compute and (e["cat"] == "gpu_memcpy" or
                                                   (e["cat"] == "kernel" and "copy" in e["name"].lower()))

    copies = [e for e in gpu if is_copy(e)]
    kernels = sorted((e["ts"], e["ts"] + e["dur"]) for e in gpu
                     if e["args"]["stream"] == compute and e["cat"] == "kernel")
    overlapping = sum(1 for c in copies if any(a < c["ts"] + c["dur"] and c["ts"] < b for a, b in kernels))
    streams = sorted({c["args"]["stream"] for c in copies})
    print(f"streams: kernel time per stream (us) {dict(sorted(kernel_time.items()))}")
    print(f"streams: {len(copies)} transfer copies on stream(s) {streams}, compute kernels ({len(kernels)}) on stream "
          f"{compute}; {overlapping} of the copies overlap a compute kernel; trace in {args.trace}")
    return bool(copies) and compute not in streams and overlapping > 0


def _copies_on_side_stream(trace: str, kinds: tuple[str, ...]) -> tuple[int, int, int]:
    """(copies of ``kinds`` in the trace, how many ran off the compute stream, how many of those
    overlapped a compute kernel)."""
    with open(trace) as fh:
        events = json.load(fh)["traceEvents"]
    gpu = [e for e in events if e.get("ph") == "X" and "stream" in e.get("args", {})]
    kernel_time: dict[int, float] = {}
    for e in gpu:
        if e.get("cat") == "kernel":
            kernel_time[e["args"]["stream"]] = kernel_time.get(e["args"]["stream"], 0.0) + e["dur"]
    compute = max(kernel_time, key=kernel_time.get, default=None)
    kernels = sorted((e["ts"], e["ts"] + e["dur"]) for e in gpu if e["args"]["stream"] == compute
                     and e.get("cat") == "kernel")
    copies = [e for e in gpu if e.get("cat") == "gpu_memcpy" and any(k in e["name"] for k in kinds)]
    side = [c for c in copies if c["args"]["stream"] != compute]
    overlapping = sum(1 for c in side if any(a < c["ts"] + c["dur"] and c["ts"] < b for a, b in kernels))
    return len(copies), len(side), overlapping


def check_offload(args) -> bool:
    import torch
    from torch.profiler import ProfilerActivity, profile

    import autopar
    from autopar.examples.gpt import make_gpt

    def run(offload, steps=2, trace=None):
        model, inputs, target, loss_fn = make_gpt(n_layer=args.layers, d_model=args.d_model, n_head=args.heads,
                                                  seq_len=args.seq, batch_size=args.batch, seed=0)
        model, inputs, target = model.cuda(), tuple(x.cuda() for x in inputs), target.cuda()
        pm = autopar.parallelize(model, inputs, loss_fn=loss_fn, optimizer=functools.partial(torch.optim.SGD, lr=LR),
                                 plan=autopar.Plan(pp=2, schedule="zb-h1", num_microbatches=8, offload=offload),
                                 example_target=target)
        losses = [pm.step(inputs, target) for _ in range(steps)]
        if trace:
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                losses.append(pm.step(inputs, target))
                torch.cuda.synchronize()
            prof.export_chrome_trace(trace)
        return losses, pm.state_dict(), pm.metrics.get("offloaded_bytes", 0)

    (l0, s0, _), (l1, s1, moved) = run(0.0), run(1.0)
    same = all(torch.equal(a, b) for a, b in zip(l0, l1)) and all(torch.equal(s0[k], s1[k]) for k in s0)
    trace = args.trace.replace(".json", "_offload.json")
    run(1.0, steps=1, trace=trace)
    n, side, overlapping = _copies_on_side_stream(trace, ("DtoH", "HtoD", "Device -> Pinned", "Pinned -> Device"))
    print(f"offload: bitwise equal with and without: {same}; {moved / 2**20:.1f} MiB copied out a step; {n} "
          f"device<->host copies, {side} off the compute stream, {overlapping} of those overlap a compute kernel; "
          f"trace in {trace}")
    return same and moved > 0 and side > 0 and overlapping > 0


def check_chunked_loss(args) -> bool:
    import torch

    import autopar
    from autopar.examples.gpt import make_gpt

    def run(chunk):
        model, inputs, target, loss_fn = make_gpt(n_layer=args.layers, d_model=args.d_model, n_head=args.heads,
                                                  seq_len=args.seq, batch_size=args.batch, seed=0)
        model, inputs, target = model.cuda(), tuple(x.cuda() for x in inputs), target.cuda()
        pm = autopar.parallelize(model, inputs, loss_fn=loss_fn, optimizer=functools.partial(torch.optim.SGD, lr=LR),
                                 plan=autopar.Plan(pp=2, schedule="zbv", num_microbatches=4,
                                                   loss_chunk_tokens=chunk), example_target=target)
        return [float(pm.step(inputs, target)) for _ in range(2)], pm.state_dict()

    (l0, s0), (l1, s1) = run(0), run(max(1, args.seq // 2))
    worst = max(float((s1[k] - s0[k]).abs().max() / s0[k].abs().max().clamp_min(1e-30)) for k in s0)
    loss_err = max(abs(a - b) / abs(b) for a, b in zip(l1, l0))
    print(f"chunked loss: loss rel. difference {loss_err:.2e}, worst parameter {worst:.2e} (rtol {args.rtol:g} / 1e-4)")
    return loss_err <= args.rtol and worst <= 1e-4


def check_muon(args) -> bool:
    """autopar.Muon in local mode on CUDA (pp=2 zbv: the routed matrices orthogonalized on the
    device) against eager torch.optim.Muon + torch.optim.AdamW on the same routing, two steps,
    both with float32 Newton-Schulz (torch's bfloat16 cast made a copy: bf16 rounds gradients
    that differ in their last bits apart, tests/reference.EagerMuonAdamW): loss rtol, parameters
    1e-4 relative + 1e-5 absolute; then the default bfloat16 Newton-Schulz runs (finite losses)."""
    from unittest import mock

    import torch

    import autopar
    from autopar.examples.gpt import make_gpt
    from autopar.passes import capture
    from autopar.passes.optimizer_routing import route_parameters

    def case():
        model, inputs, target, loss_fn = make_gpt(n_layer=args.layers, d_model=args.d_model, n_head=args.heads,
                                                  seq_len=args.seq, batch_size=args.batch, seed=0)
        return model.cuda(), tuple(x.cuda() for x in inputs), target.cuda(), loss_fn

    spec = autopar.Muon(lr=0.02, adamw_lr=3e-3, ns_dtype=torch.float32)
    model, inputs, target, loss_fn = case()
    routes = route_parameters(capture(model, inputs, target, loss_fn))
    ref = copy.deepcopy(model)
    params = dict(ref.named_parameters())
    muon = torch.optim.Muon([p for f, p in params.items() if routes[f].muon], lr=spec.lr,
                            weight_decay=spec.weight_decay, momentum=spec.momentum)
    adamw = torch.optim.AdamW([p for f, p in params.items() if not routes[f].muon], lr=spec.adamw_lr,
                              betas=spec.adamw_betas, eps=spec.adamw_eps, weight_decay=spec.adamw_weight_decay)
    want = []
    for _ in range(2):
        total = 0.0
        for x, y in zip(inputs[0].chunk(4), target.chunk(4)):
            loss = loss_fn(ref(x), y) / 4
            loss.backward()
            total += float(loss)
        want.append(total)
        with mock.patch.object(torch.Tensor, "bfloat16", torch.Tensor.clone):
            muon.step()
        adamw.step()
        muon.zero_grad()
        adamw.zero_grad()
    pm = autopar.parallelize(model, inputs, loss_fn=loss_fn, optimizer=spec, example_target=target,
                             plan=autopar.Plan(pp=2, schedule="zbv", num_microbatches=4))
    got = [float(pm.step(inputs, target)) for _ in range(2)]
    state, ref_state = pm.state_dict(), ref.state_dict()
    # assert_close's rule (tests/reference.assert_close_state): |got - want| <= 1e-5 + 1e-4 |want|
    worst = max(float(((state[k] - ref_state[k]).abs() - 1e-4 * ref_state[k].abs()).max()) for k in ref_state)
    loss_err = max(abs(a - b) / abs(b) for a, b in zip(got, want))
    model, inputs, target, loss_fn = case()
    pm = autopar.parallelize(model, inputs, loss_fn=loss_fn, optimizer=autopar.Muon(lr=0.02), example_target=target,
                             plan=autopar.Plan(pp=2, schedule="zbv", num_microbatches=4))
    bf16 = [float(pm.step(inputs, target)) for _ in range(2)]
    finite = all(math.isfinite(v) for v in bf16)
    print(f"muon: loss rel. difference {loss_err:.2e}, worst parameter excess over 1e-4 relative {worst:.2e} "
          f"(rtol {args.rtol:g} / 1e-5 absolute); bf16 Newton-Schulz losses {bf16}")
    return loss_err <= args.rtol and worst <= 1e-5 and finite


NCCL_SCHEDULES = ("1f1b", "zbv", "dualpipev")


def _nccl_rank(rank, world, schedule, args):
    import torch

    import autopar
    from autopar.examples.gpt import make_gpt

    os.environ["AUTOPAR_P2P_PREFETCH"] = "0"  # the GPU default, said out loud
    torch.backends.cuda.matmul.allow_tf32 = False
    model, inputs, target, loss_fn = make_gpt(n_layer=args.layers, d_model=args.d_model, n_head=args.heads,
                                              seq_len=args.seq, batch_size=args.batch, seed=0)
    dev = torch.device("cuda", rank)
    model, inputs, target = model.to(dev), tuple(x.to(dev) for x in inputs), target.to(dev)
    pm = autopar.parallelize(model, inputs, loss_fn=loss_fn, optimizer=functools.partial(torch.optim.SGD, lr=LR),
                             plan=autopar.Plan(pp=2, schedule=schedule, num_microbatches=4), example_target=target,
                             timeout=120)
    losses = [float(pm.step(inputs, target)) for _ in range(2)]
    return losses, {k: v.detach().cpu() for k, v in pm.state_dict().items()}


def check_nccl_pipeline(args) -> bool:
    """Check 6: pp=2 over NCCL under each of NCCL_SCHEDULES against eager on one GPU (skipped,
    and passing, on a machine with fewer than 2 GPUs)."""
    import torch

    from autopar.examples.gpt import make_gpt
    from autopar.runtime.spawn import run_ranks

    if torch.cuda.device_count() < 2:
        print(f"nccl pipeline: skipped, {torch.cuda.device_count()} GPU here (NCCL needs a GPU per rank)")
        return True
    model, inputs, target, loss_fn = make_gpt(n_layer=args.layers, d_model=args.d_model, n_head=args.heads,
                                              seq_len=args.seq, batch_size=args.batch, seed=0)
    ref = copy.deepcopy(model).cuda()
    opt = torch.optim.SGD(ref.parameters(), lr=LR)
    want = []
    for _ in range(2):
        total = 0.0
        for x, y in zip(inputs[0].cuda().chunk(4), target.cuda().chunk(4)):
            loss = loss_fn(ref(x), y) / 4
            loss.backward()
            total += float(loss)
        want.append(total)
        opt.step()
        opt.zero_grad()
    ref_state = {k: v.detach().cpu() for k, v in ref.state_dict().items()}
    ok = True
    for schedule in NCCL_SCHEDULES:
        results = run_ranks(_nccl_rank, 2, schedule, args, backend="nccl", timeout_s=120, deadline_s=600)
        for rank, (losses, state) in enumerate(results):
            loss_err = max(abs(a - b) / abs(b) for a, b in zip(losses, want))
            worst = max(float((state[k] - v).abs().max()) / max(float(v.abs().max()), 1e-12)
                        for k, v in ref_state.items())
            good = loss_err <= args.rtol and worst <= 1e-4
            ok = ok and good
            print(f"nccl pipeline {schedule} rank {rank}: loss rel. difference {loss_err:.2e}, worst parameter "
                  f"{worst:.2e} {'OK' if good else 'FAIL'}")
    return ok


def main(argv=None) -> int:
    args = _parse(argv)
    import torch

    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; run it on a GPU machine", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    print(f"gpu_check: torch {torch.__version__}, {torch.cuda.get_device_name()}")
    ok_num = check_numerics(args)
    ok_streams = check_streams(args)
    ok_offload = check_offload(args)
    ok_chunk = check_chunked_loss(args)
    ok_muon = check_muon(args)
    ok_nccl = check_nccl_pipeline(args)
    print(f"RESULT numerics {'OK' if ok_num else 'FAIL'}, streams {'OK' if ok_streams else 'FAIL'}, offload "
          f"{'OK' if ok_offload else 'FAIL'}, chunked loss {'OK' if ok_chunk else 'FAIL'}, muon "
          f"{'OK' if ok_muon else 'FAIL'}, nccl pipeline {'OK' if ok_nccl else 'FAIL'}")
    return 0 if ok_num and ok_streams and ok_offload and ok_chunk and ok_muon and ok_nccl else 1


if __name__ == "__main__":
    sys.exit(main())
