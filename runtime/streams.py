"""Where communication runs relative to compute: a side stream on CUDA, inline on CPU.

On CUDA the runtime launches every P2P transfer and every bucketed gradient reduction inside
``CommStream.launch()``: the side stream first waits on an event recorded on the compute
stream (so the transfer reads finished values), then the collective is issued from it, and
the compute stream goes on queueing kernels. A consumer orders itself after a collective
with the c10d work's ``wait()`` (NCCL: the current stream waits on NCCL's completion event),
after a stand-in copy with ``wait`` on the side stream's event. No ``record_stream``: every tensor a
transfer reads or writes stays referenced by its handle until ``wait`` ran (sends: until the
end of the step), so the caching allocator cannot hand its memory to another kernel while
the transfer may still touch it (NCCL is told the same with
``TORCH_NCCL_AVOID_RECORD_STREAMS=1``, set in collectives/comms.py before any process group
exists).

On CPU (gloo) there is no stream: ``launch`` is a no-op and gloo's asynchronous work handles
are the concurrency, and a stand-in copy is done when ``copy`` returns.

``copy`` is the stand-in transfer for one device: the values are copied on the side stream
(what a P2P receive does to a fresh buffer); local mode uses it for activations and
gradients crossing pipeline ranks when asked (``parallelize(..., local_transfers=True)``),
which is how stream/event ordering is exercised, and checked against eager, on one GPU.
"""
from __future__ import annotations

import contextlib

import torch


class Transfer:
    """Values in flight: ``wait()`` returns them once the current stream is ordered after the
    copy. Keeps the sources alive until then (they are read on the side stream)."""

    def __init__(self, values: dict[str, torch.Tensor], done, sources: dict[str, torch.Tensor], stream: "CommStream"):
        self.values, self.done, self._sources, self._stream = values, done, sources, stream

    def wait(self) -> dict[str, torch.Tensor]:
        self._stream.wait(self.done)
        self._sources = None
        return self.values


class CommStream:
    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(device=self.device) if self.cuda else None

    @contextlib.contextmanager
    def launch(self):
        """Issue the block's communication on the side stream, after the compute queued so far."""
        if not self.cuda:
            yield
            return
        ready = torch.cuda.current_stream(self.device).record_event()
        self.stream.wait_event(ready)
        with torch.cuda.stream(self.stream):
            yield

    def done_event(self):
        """An event on the side stream after what was launched on it so far (None on CPU)."""
        return self.stream.record_event() if self.cuda else None

    def wait(self, event) -> None:
        """Order the current stream after ``event`` (from ``done_event``; None on CPU: nothing
        to wait for, the copy already ran)."""
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def copy(self, values: dict[str, torch.Tensor]) -> Transfer:
        """Copy ``values`` into fresh tensors (``empty_like``: same layout) on the side stream."""
        # destinations are allocated on the compute stream, which only touches them after wait()
        dst = {n: torch.empty_like(t) for n, t in values.items()}
        with self.launch():
            for n, t in values.items():
                dst[n].copy_(t, non_blocking=True)
            done = self.done_event()
        return Transfer(dst, done, dict(values), self)
