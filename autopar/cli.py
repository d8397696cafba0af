"""`autopar` command line: demo, plan, schedule, inspect, checkpoint. Subcommands import only what they need."""
from __future__ import annotations

import argparse
import os
import sys


def main(argv: list[str] | None = None) -> int:
    standalone = argv is None  # the console script, not a caller in Python
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "schedule":
        from autopar.schedules.cli import main as schedule_main

        return schedule_main(argv[1:])
    if argv and argv[0] == "plan":
        from autopar.planner.cli import main as plan_main

        rc = plan_main(argv[1:])
        if standalone:  # the process ends here: skip freeing millions of schedule actions one by one (~2 s)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(rc or 0)
        return rc
    parser = argparse.ArgumentParser(prog="autopar", description="graph-capture auto-parallelizer for PyTorch training")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("schedule", help="print, simulate and export pipeline schedules (autopar schedule --help)")
    sub.add_parser("plan", help="pick degrees, schedule, microbatches and stage boundaries for a model on N devices "
                                "(autopar plan --help)")
    demo = sub.add_parser("demo", help="capture examples/gpt, plan it, train a few steps on CPU processes, "
                                       "compare with eager")
    _model_args(demo)
    demo.add_argument("--nproc", type=int, default=2,
                      help="CPU processes (gloo), launched by torch's elastic launcher; 1 = local mode, every "
                           "rank in this process (default 2)")
    demo.add_argument("--steps", type=int, default=5, help="optimizer steps (default 5)")
    demo.add_argument("--lr", type=float, default=1e-3)
    demo.add_argument("--meta", action=argparse.BooleanOptionalAction, default=True,
                      help="build the GPT on the meta device; each process materializes only its stages (default; "
                           "--no-meta builds it whole first)")
    demo.add_argument("--bf16", action="store_true", help="bf16 mixed precision (fp32 masters and gradients)")
    insp = sub.add_parser("inspect", help="write every stage's F/I/W/B code and the stage table to a directory")
    _model_args(insp)
    insp.add_argument("--out", default="autopar_dump", help="output directory (default ./autopar_dump)")
    ckpt = sub.add_parser("checkpoint", help="checkpoints written by pm.save (autopar checkpoint export --help)")
    ckpt_sub = ckpt.add_subparsers(dest="action", required=True)
    export = ckpt_sub.add_parser("export", help="write a checkpoint's model weights (fp32 masters under mixed "
                                                "precision) as safetensors, for parallelize(weights=) and transformers")
    export.add_argument("dir", help="the checkpoint directory (pm.save)")
    export.add_argument("out", help="a .safetensors file, or a directory (HF-style model.safetensors.index.json and "
                                    "shards; add the model's config.json for from_pretrained)")
    export.add_argument("--max-shard-gb", type=float, default=5.0, help="largest shard of a directory (default 5)")
    args = parser.parse_args(argv)
    try:
        if args.command == "demo":
            from autopar.demo import run_demo

            return run_demo(args)
        if args.command == "inspect":
            from autopar.demo import run_inspect

            return run_inspect(args)
        if args.command == "checkpoint":
            from autopar.checkpoint import export as export_checkpoint

            for path in export_checkpoint(args.dir, args.out, max_shard_bytes=int(args.max_shard_gb * 2**30)):
                print(path)
            return 0
    except ValueError as e:
        print(f"autopar {args.command}: {e}", file=sys.stderr)
        return 2
    parser.error(f"unknown command {args.command}")
    return 2


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pp", type=int, default=None, help="pipeline ranks (demo default: the planner's choice; with "
                                                     "other plan flags: --nproc / dp, or 2 in local mode)")
    p.add_argument("--dp", type=int, default=None, help="data-parallel replicas (demo default: the planner's; else 1)")
    p.add_argument("--tp", type=int, default=None, help="tensor-parallel degree (default 1; the demo's planner does "
                                                     "not choose tp)")
    p.add_argument("--schedule", default=None, help="pipeline schedule (demo default: the planner's; else 1f1b; "
                                                    "see autopar schedule --list)")
    p.add_argument("--microbatches", type=int, default=None, help="microbatches per step (default: schedule's choice)")
    p.add_argument("--stages-per-rank", type=int, default=None)
    p.add_argument("--layers", type=int, default=4, help="GPT layers (default 4)")
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--batch", type=int, default=8, help="global batch (default 8)")
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--compile", action="store_true", help="run every stage program compiled by Inductor "
                                                          "(Plan(compile=True); the first step compiles; without "
                                                          "plan flags the planner times its units compiled first, "
                                                          "about 2 min cold on 2 cores)")


if __name__ == "__main__":
    sys.exit(main())
