"""Peak live tensor bytes of this process over a window: ``PeakTensorMemory``.

    with PeakTensorMemory(baseline=params + grads + optimizer_states) as probe:
        pm.step(inputs, target)
    probe.peak_bytes, probe.baseline_bytes, probe.live_bytes

What is counted, exactly:

* on enter, the distinct *storages* behind the tensors passed as ``baseline`` (a view and its
  base, or two parameters sharing a storage, count once; zero-size and meta tensors count 0);
* while active, a ``TorchDispatchMode`` sees every ATen op that runs in this process's threads
  that carry the mode (the calling thread, and the CPU autograd engine, which inherits it):
  the untyped storage of every output tensor is counted the first time it is seen, with its
  ``nbytes`` (the allocation size, not the view's size). That covers every op of the F/I/W/B
  programs, the runtime's own tensor work (``torch.empty`` receive buffers in
  ``runtime/distributed.py``, ``.contiguous()`` copies before ``isend``, gradient
  accumulation, bucket flattening, the ZeRO-1 flat buffers) and the optimizer's state and
  temporaries;
* a storage that already existed before enter and was not in ``baseline`` is counted when an
  op first returns it (e.g. a view of the input batch), from then on;
* an in-place op that grows a storage (``resize_``, ``out=`` variants) is re-counted at its
  new size the next time an op returns it;
* a counted storage is subtracted when it is freed: ``weakref.finalize`` on the Python
  storage object (PyTorch preserves one Python object per storage for the storage's whole
  life, so the finalizer runs exactly when the C++ storage dies, whoever held it last).

The peak is the largest running total at any op boundary or free.

Not counted: memory the process allocates outside ATen ops: gloo's internal staging buffers
and sockets, the caching allocator's or malloc's slack and fragmentation, Python objects,
CUDA/NCCL contexts; tensors created in threads without the mode (e.g. a collective's own C++
threads); storages that existed before enter, were not passed as ``baseline`` and are never
returned by an op in the window. It is the quantity the planner's memory model predicts for
the ``cpu`` profile (live tensor bytes, ``runtime`` overhead 0), not the process RSS.

The dispatch mode costs tens of microseconds per op: never time a step with the probe active.
"""
from __future__ import annotations

import threading
import weakref
from typing import Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

__all__ = ["PeakTensorMemory", "storage_bytes"]


def _plain(tensors) -> Iterable[torch.Tensor]:
    """Tensors with storage: wrapper subclasses (DTensor: FSDP2's sharded parameters) are
    replaced by the tensors they wrap."""
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        if is_traceable_wrapper_subclass(t):
            attrs, _ctx = t.__tensor_flatten__()
            yield from _plain(getattr(t, a) for a in attrs)
        else:
            yield t


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views and shared storages once)."""
    seen, total = set(), 0
    for t in _plain(tensors):
        if not isinstance(t, torch.Tensor) or t.is_meta or t.layout != torch.strided:
            continue
        st = t.untyped_storage()
        key = st._cdata
        if key not in seen:
            seen.add(key)
            total += st.nbytes()
    return total


class _Mode(TorchDispatchMode):
    def __init__(self, probe: "PeakTensorMemory"):
        super().__init__()
        self.probe = probe

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in _plain(tree_leaves(out)):
            if isinstance(t, torch.Tensor):
                self.probe._see(t)
        return out


class PeakTensorMemory:
    """Context manager: the peak of live tensor bytes in this process while active (see the
    module docstring for exactly what is counted). ``baseline``: tensors alive at enter that
    belong to the measurement (parameters, their gradients, optimizer states). ``skip``:
    storage -> True for storages that are not counted (``HostPool.owns`` of an activation
    offload on a CPU device, whose "host" buffers live in the same memory)."""

    def __init__(self, baseline: Iterable[torch.Tensor] = (), skip=None):
        self._baseline = [t for t in baseline if isinstance(t, torch.Tensor)]
        self._skip = skip  # storage -> True for storages that are not the device's (an offload host pool)
        self._lock = threading.RLock()  # finalizers may run in another thread (e.g. gloo's)
        self._live: dict[int, tuple[int, weakref.finalize]] = {}
        self.live_bytes = 0
        self.peak_bytes = 0
        self.baseline_bytes = 0
        self.counted_storages = 0
        self._mode: _Mode | None = None
        self._active = False

    # -- bookkeeping ------------------------------------------------------------------------

    def _see(self, t: torch.Tensor) -> None:
        if t.is_meta or t.layout != torch.strided or not self._active:
            return
        st = t.untyped_storage()
        n = st.nbytes()
        if n == 0 or (self._skip is not None and self._skip(st)):
            return
        key = st._cdata
        with self._lock:
            hit = self._live.get(key)
            if hit is not None:
                if hit[0] == n:
                    return
                # resized in place: replace the entry at the new size
                hit[1].detach()
                self.live_bytes -= hit[0]
            fin = weakref.finalize(st, self._free, key)
            fin.atexit = False
            self._live[key] = (n, fin)
            self.counted_storages += 1
            self.live_bytes += n
            if self.live_bytes > self.peak_bytes:
                self.peak_bytes = self.live_bytes

    def _free(self, key: int) -> None:
        with self._lock:
            hit = self._live.pop(key, None)
            if hit is not None:
                self.live_bytes -= hit[0]

    # -- context manager ----------------------------------------------------------------------

    def __enter__(self) -> "PeakTensorMemory":
        self._active = True
        for t in _plain(self._baseline):
            self._see(t)
        self._baseline = []  # no strong references held past enter: they may be freed inside
        self.baseline_bytes = self.live_bytes
        self.peak_bytes = self.live_bytes
        self._mode = _Mode(self)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)
        self._mode = None
        with self._lock:
            self._active = False
            for _n, fin in self._live.values():
                fin.detach()
            self._live.clear()
