"""Activation offload: what F keeps for I and W, parked in host memory while the schedule waits.

Under 1F1B and the zero-bubble schedules a stage holds several microbatches between their F
and their I/W (the warm-up), each with everything F saved. ``ActivationOffload`` moves a fixed
share of those tensors to host memory right after F and brings each back before the program
that reads it: before I the ones I reads, before W the rest (tensors only W reads stay away
through I), before a fused B all of them.

Which tensors: per stage, once, at build (``choose``): of the floating values F leaves for I/W
(saved values and kept stage inputs: the *eligible* bytes), at least ``fraction`` of the
eligible bytes, overshooting little (``at_least``; all of them at 1.0, none at 0): the planner
prices exactly that share, so the run holds no more than it predicted. At run time they are
parked by storage: each storage once, with every chosen value that views it, and not at all when
anything else still holds it (another value the env keeps, the outputs on their way to the next
stage, the data, a parameter: the copy would free nothing). A storage's bytes are copied as
they are and each value is rebuilt with its dtype, shape, strides and offset, so what comes back
is bit for bit what left.

On CUDA the copies run on a side stream into pinned host buffers: the copy out waits for F on
the compute stream, the device tensor is handed to the allocator at once (``record_stream``
keeps its memory until the copy is done); the copy back waits for that copy, and the compute
stream waits for the copy back before the program runs. The distributed executor calls
``prefetch`` one action ahead: the copy back of the next backward's values starts right after
the current action. On a CPU device the "host" copy goes to buffers the pool keeps apart
(``HostPool.owns``), so the runtime's memory probe can tell what left the device's accounting;
the copies are synchronous there.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.utils._pytree import tree_leaves

from autopar.passes import keys
from autopar.passes.costs import view_base


@dataclass
class _Storage:
    """One offloaded storage: its bytes in a host buffer (and, once brought back, on the device)."""

    buffer: torch.Tensor      # uint8 [nbytes] on the host
    copied: object = None     # CUDA event: the copy out is done
    back: object = None       # the device storage it was brought back into


@dataclass
class _Parked:
    """One offloaded value: a view (dtype, shape, strides, offset) of a parked storage."""

    storage: _Storage
    dtype: torch.dtype
    shape: tuple
    stride: tuple
    offset: int


def _park(value, boxes: dict):
    """``value`` (a tensor, or a tuple/list of them and others) with each tensor as a view of
    its parked storage."""
    if isinstance(value, torch.Tensor):
        return _Parked(boxes[value.untyped_storage()._cdata], value.dtype, tuple(value.shape), tuple(value.stride()),
                       value.storage_offset())
    if isinstance(value, (tuple, list)):
        return type(value)(_park(v, boxes) for v in value)
    return value


def _boxes(parked) -> list[_Storage]:
    if isinstance(parked, _Parked):
        return [parked.storage]
    if isinstance(parked, (tuple, list)):
        return [b for v in parked for b in _boxes(v)]
    return []


class HostPool:
    """Host buffers reused across microbatches and steps (pinned when the device is CUDA)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.free: dict[int, list[torch.Tensor]] = {}
        self._owned: set[int] = set()  # storage handles of every buffer (CPU: kept off the device's accounting)
        self.in_use_bytes = 0
        self.peak_bytes = 0

    def take(self, nbytes: int) -> torch.Tensor:
        stack = self.free.get(nbytes)
        if stack:
            buf = stack.pop()
        else:
            buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.device.type == "cuda")
            self._owned.add(buf.untyped_storage()._cdata)
        self.in_use_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.in_use_bytes)
        return buf

    def give(self, buf: torch.Tensor) -> None:
        self.in_use_bytes -= buf.numel()
        self.free.setdefault(buf.numel(), []).append(buf)

    def owns(self, storage) -> bool:
        return storage._cdata in self._owned


def _tensors(value) -> list[torch.Tensor]:
    """The tensors in ``value`` (a tensor, or tuples, lists and dicts of them: an op's several
    results kept under one key, the env's outputs)."""
    return [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]


def eligible_bytes(prog) -> dict[str, int]:
    """Key -> bytes of the floating values stage ``prog``'s F leaves in a microbatch's env for
    I and W (saved values and kept stage inputs; not views of parameters or buffers), from the
    traced values."""
    nodes = {}
    out = next(n for n in prog.f.gm.graph.nodes if n.op == "output")
    for key, node in zip(prog.f.results, out.args[0]):
        nodes[key] = node
    phs = [n for n in prog.f.gm.graph.nodes if n.op == "placeholder"]
    for key, node in zip(prog.f.args, phs):
        nodes.setdefault(key, node)
    state = {n for n, key in zip(phs, prog.f.args) if keys.is_state(key)}
    kept = prog.keys_after("F")
    out_sizes = {}
    for k, node in nodes.items():
        leaves = _tensors(node.meta.get("val")) if isinstance(node, fx.Node) else []
        if (k in kept and (keys.is_kind(k, keys.SAVED) or keys.is_kind(k, keys.INPUT)) and leaves
                and any(t.is_floating_point() for t in leaves) and view_base(node) not in state):
            out_sizes[k] = sum(t.numel() * t.element_size() for t in leaves)
    return out_sizes


def choose(prog, fraction: float) -> frozenset[str]:
    """The keys stage ``prog`` offloads at ``fraction`` of its eligible bytes: at least that
    share, so that what the planner priced fits (module docstring)."""
    return frozenset(at_least(eligible_bytes(prog), fraction))


def at_least(sizes: dict[str, int], fraction: float) -> list[str]:
    """Keys of ``sizes`` whose bytes sum to at least ``fraction`` of all of them, overshooting
    little: the largest first while they stay within the share, then, if short, the smallest
    one left (each one left closes the gap: it was skipped for exceeding it). Ties by key."""
    budget = fraction * sum(sizes.values())
    chosen, total, rest = [], 0, []
    for key, n in sorted(sizes.items(), key=lambda kv: (-kv[1], kv[0])):
        if total + n <= budget * (1 + 1e-9):
            chosen.append(key)
            total += n
        else:
            rest.append((n, key))
    if total < budget * (1 - 1e-9) and rest:
        chosen.append(min(rest)[1])
    return chosen


class ActivationOffload:
    """The runtime policy of one process: per stage the keys it parks (``choose``), the pool,
    the copies, and what it moved (``offloaded_bytes``: per step, the bytes copied out;
    ``stage_bytes``: the same per stage)."""

    def __init__(self, programs: dict, fractions: dict[int, float], device: torch.device):
        self.device = device
        self.pool = HostPool(device)
        self.keys = {s: choose(programs[s], fractions.get(s, 0.0)) for s in programs}
        self.reads = {s: {"I": frozenset(programs[s].i.args), "W": frozenset(programs[s].w.args),
                          "B": frozenset(programs[s].b.args)} for s in programs}
        self.parked: dict[tuple[int, int], dict[str, _Parked]] = {}
        self.ready: dict[tuple[int, int], dict[str, torch.Tensor]] = {}  # prefetched, copy back in flight
        self.offloaded_bytes = 0
        self.stage_bytes: dict[int, int] = {}
        self._state: set[int] = set()  # storage handles of the parameters and buffers, per step
        self._side = torch.cuda.Stream(device) if device.type == "cuda" else None
        # the distributed executor starts each copy back one action ahead (runtime/distributed.py
        # ``_prefetch_next``); on a CPU device, where copies are synchronous, that only moves
        # memory earlier, so it is off unless asked for (tests run the path)
        self.prefetch_ahead = self._side is not None
        self._returns: list = []  # (event, host buffer): handed back to the pool once the copy back is done

    def new_step(self, state: dict) -> None:
        """Start a step: what the last one left parked (only a step that raised leaves any) is
        dropped, and the storages of ``state`` (parameters, buffers) noted: never parked."""
        boxes = {id(b): b for parked in self.parked.values() for p in parked.values() for b in _boxes(p)}
        for box in boxes.values():
            if box.back is None:
                self.pool.give(box.buffer)
        self.parked.clear()
        self.ready.clear()
        if self._side is not None:
            self._side.synchronize()
        self._recycle()
        self.offloaded_bytes = 0
        self.stage_bytes = {}
        self._state = {t.untyped_storage()._cdata for t in _tensors(list(state.values()))}

    # -- out -----------------------------------------------------------------------------------

    def after_forward(self, s: int, k: int, env: dict) -> None:
        """Park stage s's chosen values of microbatch k (right after its F). Values are parked by
        storage, each storage once; one that anything else still holds (another value of the
        env, the outputs on their way to the next stage, the data, the parameters) is not, nor
        any value that views it: the copy would free nothing."""
        chosen = self.keys.get(s)
        if not chosen:
            return
        self._recycle()
        leaves = {key: _tensors(env[key]) for key in chosen if key in env}
        held = self._state | {t.untyped_storage()._cdata for t in _tensors([v for key, v in env.items()
                                                                            if key not in leaves])}
        while True:  # a value with one held storage stays whole, and holds its other storages
            stay = [key for key, ts in leaves.items()
                    if any(t.untyped_storage()._cdata in held or t.device != self.device for t in ts)]
            if not stay:
                break
            for key in stay:
                held |= {t.untyped_storage()._cdata for t in leaves.pop(key)}
        boxes: dict[int, _Storage] = {}
        parked = self.parked.setdefault((s, k), {})
        for key, ts in leaves.items():
            for t in ts:
                st = t.untyped_storage()
                if st._cdata not in boxes:
                    boxes[st._cdata] = self._copy_out(st)
                    self.offloaded_bytes += st.nbytes()
                    self.stage_bytes[s] = self.stage_bytes.get(s, 0) + st.nbytes()
            parked[key] = _park(env.pop(key), boxes)

    def _copy_out(self, st) -> _Storage:
        buf = self.pool.take(st.nbytes())
        src = torch.empty(0, dtype=torch.uint8, device=self.device).set_(st)
        box = _Storage(buf)
        if self._side is None:
            buf.copy_(src)
            return box
        compute = torch.cuda.current_stream(self.device)
        self._side.wait_stream(compute)  # F wrote it
        with torch.cuda.stream(self._side):
            buf.copy_(src, non_blocking=True)
            box.copied = torch.cuda.Event()
            box.copied.record(self._side)
        src.record_stream(self._side)  # its memory returns to the allocator once the copy is done
        return box

    # -- back ----------------------------------------------------------------------------------

    def before(self, s: int, k: int, env: dict, program: str) -> None:
        """Bring back what stage s's ``program`` ("I", "W" or "B") reads of microbatch k."""
        if not self.parked.get((s, k)) and not self.ready.get((s, k)):
            return
        self.prefetch(s, k, program)
        ready = self.ready.pop((s, k), {})
        if self._side is not None and ready:
            torch.cuda.current_stream(self.device).wait_stream(self._side)
        env.update(ready)
        if not self.parked.get((s, k)):
            self.parked.pop((s, k), None)

    def prefetch(self, s: int, k: int, program: str) -> None:
        """Start bringing back the storages stage s's ``program`` reads of microbatch k, with every
        value that views them (one action ahead, or right before the program)."""
        parked = self.parked.get((s, k))
        if not parked:
            return
        reads = self.reads[s][program]
        boxes = {id(b): b for key in parked if key in reads for b in _boxes(parked[key])}
        ready = self.ready.setdefault((s, k), {})
        for key in [key for key in parked if any(id(b) in boxes for b in _boxes(parked[key]))]:
            ready[key] = self._unpark(parked.pop(key))
        for box in boxes.values():
            box.back = None  # the values hold the device storage now

    def _unpark(self, value):
        if isinstance(value, _Parked):
            box = value.storage
            if box.back is None:
                box.back = self._copy_back(box)
            return torch.empty(0, dtype=value.dtype, device=self.device).set_(box.back, value.offset, value.shape,
                                                                              value.stride)
        if isinstance(value, (tuple, list)):
            return type(value)(self._unpark(v) for v in value)
        return value

    def _copy_back(self, box: _Storage):
        dst = torch.empty(box.buffer.numel(), dtype=torch.uint8, device=self.device)
        if self._side is None:
            dst.copy_(box.buffer)
            self.pool.give(box.buffer)
            return dst.untyped_storage()
        compute = torch.cuda.current_stream(self.device)
        self._side.wait_stream(compute)  # dst's allocation is ordered on the compute stream
        with torch.cuda.stream(self._side):
            self._side.wait_event(box.copied)
            dst.copy_(box.buffer, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._side)
        dst.record_stream(self._side)
        self._returns.append((done, box.buffer))
        return dst.untyped_storage()

    def _recycle(self) -> None:
        keep = []
        for ev, buf in self._returns:
            if ev.query():
                self.pool.give(buf)
            else:
                keep.append((ev, buf))
        self._returns = keep
