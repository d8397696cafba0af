"""One owner per parallelism (``autopar.parallel``).

=====================  =====================================================================
pipeline.py            PipelineParallel: stages on pipeline ranks, tied-parameter groups and
                       sums, whole state from the rank that owns it
data.py                DataParallel: dp*cp replicas, gradient reduction, ZeRO 0-3 (layout,
                       storage, ZeRO-3 program rewrite, optimizer wrapping, shard mapping)
context.py             ContextParallel: sequence sharding, the Ulysses graph rewrite
expert.py              ExpertParallel: experts sharded over ep ranks, their state mapping
zero_layout.py         ZeRO-2/3 layer groups as data (also read by planner/memory_model.py)
base.py                what every owner offers the orchestrator (autopar/build.py)
=====================  =====================================================================

This package's ``__init__`` imports nothing, so ``autopar.parallel.zero_layout`` stays
importable without torch.
"""
