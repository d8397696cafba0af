"""`autopar plan MODEL --gpus N ...`: capture the model, search plans, print the report.

MODEL is a preset name (``autopar plan --list``), ``--hf-config config.json`` (a Hugging Face
causal LM from its configuration: planner/hf_config.py) or ``--model pkg.module:factory`` where the
factory returns ``(model, example_inputs)``, ``(model, example_inputs, loss_fn)`` with
``loss_fn(output) -> scalar``, or ``(model, example_inputs, target, loss_fn)`` with
``loss_fn(output, target)``. Exit status: 0 a plan fits, 2 no plan fits or bad input.
"""
from __future__ import annotations

import argparse
import importlib
import json
import re
import sys
import time

_UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12,
          "kib": 2 ** 10, "mib": 2 ** 20, "gib": 2 ** 30, "tib": 2 ** 40}


def parse_bytes(text: str) -> float:
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"--memory {text!r}: expected a size such as 80GiB, 141GB or 512MiB")
    value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if value <= 0:
        raise ValueError(f"--memory {text!r} must be positive")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="autopar plan", description="pick PP/DP/CP/EP degrees, the pipeline schedule, "
                                "microbatches and stage boundaries for a model on N devices, and say why")
    p.add_argument("preset", nargs="?", help="preset model name (see --list)")
    p.add_argument("--model", help="pkg.module:factory returning (model, example_inputs[, target], [loss_fn])")
    p.add_argument("--hf-config", help="a Hugging Face config.json (or the directory holding it): its causal LM, "
                                       "built on the meta device (no weights, no download)")
    p.add_argument("--list", action="store_true", help="list presets and device profiles")
    p.add_argument("--gpus", type=int, help="devices in the job (world size)")
    p.add_argument("--gpus-per-node", type=int, default=None, help="devices per node (default: the profile's, 8)")
    p.add_argument("--device", default="h100", help="device profile: h100 (default), h200, a100-80gb, mi300x, b200, "
                                                   "cpu (measured here), or current")
    p.add_argument("--memory", default=None, help="memory limit per device, e.g. 80GiB (default: the profile's)")
    p.add_argument("--global-batch", type=int, help="samples per optimizer step")
    p.add_argument("--seq", type=int, default=None, help="sequence length (presets; default 4096)")
    p.add_argument("--top", type=int, default=5, help="alternatives to show (default 5)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the report")
    p.add_argument("--all", action="store_true", help="simulate and list every feasible candidate (slower)")
    p.add_argument("--schedules", default=None, help="comma-separated schedules to search (default: all)")
    p.add_argument("--no-cp", action="store_true", help="do not search context parallelism")
    p.add_argument("--no-ep", action="store_true", help="do not search expert parallelism")
    p.add_argument("--no-tp", action="store_true", help="do not search tensor parallelism")
    p.add_argument("--no-loss-chunk", action="store_true",
                   help="never chunk the cross-entropy (by default it is chunked where memory binds)")
    p.add_argument("--optimizer", choices=("adamw", "muon"), default="adamw",
                   help="the optimizer to price: adamw, or muon (autopar.Muon: hidden matrices with one momentum "
                        "and Newton-Schulz, the rest AdamW)")
    p.add_argument("--compile", action="store_true",
                   help="plans run their stage programs compiled by Inductor (Plan(compile=True)); with --device "
                        "cpu/current and --model the units are timed compiled (analytic devices price the same ops)")
    p.add_argument("--no-cache", action="store_true",
                   help="capture and trace the model even if its profile is in the disk cache, and do not write it "
                        "there ($AUTOPAR_CACHE_DIR/profiles, default ~/.cache/autopar)")
    p.add_argument("--no-offload", action="store_true",
                   help="never offload activations to host memory (by default priced where memory binds)")
    p.add_argument("--max-zero", type=int, default=3, choices=(0, 1, 2, 3), help="highest ZeRO level to search")
    p.add_argument("--pin", default=None, help="fix layout fields and search the rest, e.g. "
                                               "pp=16,ep=64,dp=128,zero=1 (pp, dp, cp, ep, zero, schedule, "
                                               "microbatches, v, b)")
    p.add_argument("--moe-imbalance", type=float, default=None,
                   help="max/mean ratio of the routed rows an expert-parallel rank receives in a dropless MoE "
                        "(default 1.25, the capacity factor Switch Transformers and GShard train with); prices the "
                        "worst rank's all-to-all, expert compute and saved rows")
    p.add_argument("--lengths", default=None, metavar="FILE",
                   help="document lengths in tokens, one a line: packed into rows of --seq (autopar.data), the "
                        "report gives the fill and tokens/s of real tokens")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    return p


def read_lengths(path: str, seq_len: int) -> dict:
    """``--lengths FILE``: one positive integer a line (blank lines and ``#`` comments skipped),
    packed into rows of ``seq_len`` (autopar.data.packing_stats)."""
    from autopar.data import packing_stats

    lengths = []
    with open(path) as fh:
        for i, line in enumerate(fh, start=1):
            text = line.split("#", 1)[0].strip()
            if not text:
                continue
            if not text.isdigit() or int(text) < 1:
                raise ValueError(f"--lengths {path} line {i}: {text!r} is not a positive integer (one document "
                                 "length in tokens a line)")
            lengths.append(int(text))
    if not lengths:
        raise ValueError(f"--lengths {path}: no lengths in the file (one document length in tokens a line)")
    return {"file": path, "seq_len": seq_len, **packing_stats(lengths, seq_len)}


def load_factory(spec: str):
    if ":" not in spec:
        raise ValueError(f"--model {spec!r}: expected pkg.module:factory")
    mod_name, fn_name = spec.split(":", 1)
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise ValueError(f"--model {spec!r}: cannot import {mod_name}: {e}") from None
    fn = getattr(mod, fn_name, None)
    if not callable(fn):
        raise ValueError(f"--model {spec!r}: {mod_name} has no callable {fn_name}")
    out = fn()
    if not isinstance(out, tuple) or len(out) not in (2, 3, 4):
        raise ValueError(f"--model {spec!r}: the factory must return (model, example_inputs), "
                         "(model, example_inputs, loss_fn) or (model, example_inputs, target, loss_fn)")
    if len(out) == 4:
        model, inputs, target, loss_fn = out
    elif len(out) == 3:
        import torch.nn as nn

        model0, inputs, loss_out = out

        class _WithLoss(nn.Module):
            def __init__(self):
                super().__init__()
                self.model = model0

            def forward(self, *x):
                return loss_out(self.model(*x))

        model, target, loss_fn = _WithLoss(), None, None
    else:
        model, inputs = out
        target = loss_fn = None
    if not isinstance(inputs, tuple):
        inputs = (inputs,)
    return model, inputs, target, loss_fn


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    def say(msg: str) -> None:
        if not args.quiet:
            print(f"[autopar plan] {msg}", file=sys.stderr, flush=True)
    try:
        return _run(args, say)
    except ValueError as e:
        print(f"autopar plan: {e}", file=sys.stderr)
        return 2


def _run(args, say) -> int:
    from . import presets
    from .devices import current_profile, get_profile
    from .devices import names as device_names

    if args.list:
        print("presets: " + ", ".join(presets.names()))
        print("devices: " + ", ".join(device_names()) + ", current")
        return 0
    if sum(x is not None for x in (args.preset, args.model, args.hf_config)) != 1:
        raise ValueError("give one of: a preset name, --model pkg.module:factory, --hf-config config.json; presets: "
                         + ", ".join(presets.names()))
    if args.gpus is None or args.global_batch is None:
        raise ValueError("--gpus and --global-batch are required")
    import torch

    torch.set_num_threads(max(1, torch.get_num_threads()))
    device = current_profile() if args.device == "current" else get_profile(args.device)
    if args.gpus_per_node is not None:
        if args.gpus_per_node < 1:
            raise ValueError(f"--gpus-per-node must be >= 1, got {args.gpus_per_node}")
        import dataclasses

        device = dataclasses.replace(device, gpus_per_node=args.gpus_per_node)
    limit = parse_bytes(args.memory) if args.memory else float(device.memory_bytes)
    schedules = None
    if args.schedules:
        from autopar.schedules import names as sched_names

        schedules = tuple(x.strip() for x in args.schedules.split(",") if x.strip())
        bad = [x for x in schedules if x not in sched_names()]
        if bad:
            raise ValueError(f"--schedules: unknown {bad}; known: {', '.join(sched_names())}")
    from . import plan_model
    from .request import parse_pin

    pin = parse_pin(args.pin) if args.pin else None

    allow_ep = not args.no_ep
    seq = args.seq or 4096  # presets and --hf-config are built at this length
    if seq < 1:
        raise ValueError(f"--seq must be >= 1, got {seq}")
    if args.preset is not None:
        say(f"building preset {args.preset} on the meta device (seq {seq})")
        pm = presets.build_preset(args.preset, seq_len=seq)
        kwargs = dict(name=pm.name, layer_repeats=pm.layer_repeats, expert_prefixes=pm.expert_param_prefixes,
                      n_heads=pm.n_heads, n_experts=pm.n_experts, seq_len=seq, moe=pm.moe)
        model, inputs, target, loss_fn = pm.model, pm.inputs, pm.target, pm.loss_fn
    elif args.hf_config is not None:
        say(f"building {args.hf_config} on the meta device (seq {seq})")
        kwargs = dict(hf_config=args.hf_config, seq_len=seq)
        model = inputs = target = loss_fn = None
    else:
        model, inputs, target, loss_fn = load_factory(args.model)
        x0 = inputs[0]
        seq = int(x0.shape[1]) if isinstance(x0, torch.Tensor) and x0.dim() >= 2 else None
        if args.seq is not None and seq is not None and args.seq != seq:
            raise ValueError(f"--seq {args.seq} differs from the example inputs' sequence length {seq}; "
                             "build the example inputs at the length to plan for")
        from . import eager_model_options

        opts = eager_model_options(model)
        for why in opts["ep_refused"]:
            say(f"ep not searched: {why}")
        kwargs = dict(name=args.model, seq_len=seq, n_experts=opts["n_experts"],
                      expert_prefixes=opts["expert_prefixes"])
        allow_ep = allow_ep and opts["allow_ep"]
    t0 = time.perf_counter()
    res, info = plan_model(model, inputs, target, loss_fn, gpus=args.gpus, global_batch=args.global_batch,
                           device=device, memory_limit=limit, exhaustive=args.all, schedules=schedules,
                           allow_cp=not args.no_cp, allow_ep=allow_ep, allow_tp=not args.no_tp,
                           zero_levels=tuple(range(args.max_zero + 1)), progress=say, pin=pin,
                           moe_imbalance=args.moe_imbalance, loss_chunking=not args.no_loss_chunk,
                           offloading=not args.no_offload, optimizer=args.optimizer,
                           profile_cache=not args.no_cache, compile=args.compile, **kwargs)
    say(f"done in {time.perf_counter() - t0:.1f} s")
    if args.lengths is not None:
        info["packed"] = read_lengths(args.lengths, res.evaluator.profile.seq_len or seq)
    from .report import text, to_json

    if args.json:
        print(json.dumps(to_json(res, info, top=args.top, include_all=args.all), indent=1))
    else:
        print(text(res, info, top=args.top, include_all=args.all))
    return 0 if res.chosen is not None else 2


if __name__ == "__main__":
    sys.exit(main())
