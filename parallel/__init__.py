"""One owner per parallelism (``autopar.parallel``).

=====================  =====================================================================
pipeline.py            PipelineParallel: stages on pipeline ranks, tied-parameter groups and
                       sums, whole state from the rank that owns it
data.py                DataParallel: dp*cp replicas, gradient reduction, ZeRO 0-3 (layout,
                       storage, ZeRO-3 program rewrite, optimizer wrapping, shard mapping)
context.py             ContextParallel: sequence sharding, the Ulysses graph rewrite
expert.py              ExpertParallel: experts sharded over ep ranks, their state mapping
base.py                what every owner offers the orchestrator (autopar/build.py)
=====================  =====================================================================

The ZeRO-2/3 layer groups as data live in passes/zero_layout.py, where their lowest user
(ZeRO-3's graph rewrite, passes/zero_stream.py) can read them without importing a layer above.
"""
