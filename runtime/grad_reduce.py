"""Data-parallel gradient reduction: bucketed and overlapped, with a naive oracle beside it.

Bucketed: as soon as every stage of this rank that uses a parameter has run its last W (or
B) of the step, the parameter joins the current bucket; a full bucket is flattened into one
fp32 buffer and all-reduced asynchronously over the dp group while the pipeline goes on.
`finish()` waits and copies the sums back. Gradients were scaled by 1/(dp*m) in the loss
tangent, so the sum is the average: nothing is divided here. Parameters shared with another
pipeline rank (tied weights) are summed over their holders first, so they are reduced at the
end, after that sum.

Naive: one blocking all-reduce per parameter at the end of the step (the test oracle).
"""
from __future__ import annotations

import contextlib

import torch

from autopar.collectives import comms


class BucketedReducer:
    def __init__(self, grads, numel: dict[str, int], stage_params: dict[int, list[str]], dp_group,
                 bucket_bytes: int, deferred: set[str], comm=None, dtype: torch.dtype = torch.float32):
        """``grads.accumulator(fqn)``: the gradient to reduce (runtime/stage_work.ParamGrads);
        ``numel``: elements per FQN; ``dtype``: what the sums run in (fp32 by default)."""
        self.grads, self.numel, self.dtype = grads, numel, dtype
        self.comm = comm  # runtime/streams.CommStream: CUDA launches the all-reduce on its side stream
        self.group = dp_group
        self.bucket_bytes = bucket_bytes
        self.deferred = deferred  # reduced in finish(), after the tied-weight sum
        self.users: dict[str, set[int]] = {}
        for s, names in stage_params.items():
            for fqn in names:
                self.users.setdefault(fqn, set()).add(s)
        self.reset()

    def reset(self) -> None:
        self.pending_stages = {fqn: set(stages) for fqn, stages in self.users.items()}
        self.bucket: list[str] = []
        self.bucket_size = 0
        self.inflight: list[tuple[object, torch.Tensor, list[str]]] = []

    def stage_done(self, stage: int) -> None:
        """Every W/B of `stage` in this step has run: queue the parameters that are now final."""
        for fqn, waiting in self.pending_stages.items():
            if stage in waiting:
                waiting.discard(stage)
                if not waiting and fqn not in self.deferred:
                    self._add(fqn)

    def _add(self, fqn: str) -> None:
        self.bucket.append(fqn)
        self.bucket_size += self.numel[fqn] * 4
        if self.bucket_size >= self.bucket_bytes:
            self._launch()

    def _launch(self) -> None:
        if not self.bucket:
            return
        grads = [self.grads.accumulator(f) for f in self.bucket]  # zeros for one no microbatch reached
        flat = torch.cat([g.reshape(-1).to(self.dtype) for g in grads])  # fp32 (reduce dtype) on the wire
        with self.comm.launch() if self.comm is not None else contextlib.nullcontext():
            work = comms.all_reduce_sum(flat, group=self.group, async_op=True)
        self.inflight.append((work, flat, self.bucket))
        self.bucket, self.bucket_size = [], 0

    def finish(self, timeout) -> None:
        for fqn in sorted(self.deferred):
            self._add(fqn)
        self._launch()
        for work, flat, names in self.inflight:
            work.wait(timeout)
            offset = 0
            for fqn in names:
                g = self.grads.accumulator(fqn)
                n = g.numel()
                g.copy_(flat[offset: offset + n].view_as(g))
                offset += n
        self.inflight = []


def naive_all_reduce(grads, names, dp_group, dtype: torch.dtype = torch.float32) -> None:
    """One blocking all-reduce per gradient, in ``dtype`` (``grads.accumulator``: zeros for a
    parameter no microbatch reached, which still joins the sum)."""
    for fqn in names:
        g = grads.accumulator(fqn)
        wire = g if g.dtype == dtype else g.to(dtype)
        comms.all_reduce_sum(wire, group=dp_group)
        if wire is not g:
            g.copy_(wire)
