"""Real values for a model's tensors, a few at a time: from the live module, a checkpoint, or
an initialization that does not depend on the plan.

A model built on the meta device has shapes and no values. Each rank asks a ``Values`` for
the whole values of the tensors it holds (a group at a time, so a ZeRO-3 rank never holds more
than one layer group whole) and keeps what its plan says (a shard, an expert slice, a compute
copy). Three sources:

* ``LiveValues``: the module's own tensors (a model that is already materialized);
* ``CheckpointValues``: a checkpoint (runtime/weights.py), read tensor by tensor; buffers a
  checkpoint never holds (non-persistent ones, such as RoPE tables) come from the init;
* ``InitValues``: the model's own initialization, run with **one random generator per
  tensor**, seeded from (seed, the tensor's FQN, how many random ops it has seen), so every
  tensor gets the same values whichever other tensors are real at that moment, under every
  plan, and in ``init_weights`` (the eager way to reproduce it).

The initialization is what building the model eagerly does: every module's
``reset_parameters()`` (torch's defaults: LayerNorm weights 1, ...), then the ``init_fn(model)``
given, else ``model.init_weights()`` if there is one (torchtitan's and Hugging Face's
convention: HF runs each module's ``_init_weights``). It runs on the whole
module with only the requested tensors real (others stay on the meta device, where an op does
nothing and draws no random numbers) and only in-place random ops on a tensor are reseeded:
a random value drawn into a temporary and copied in (``p.copy_(torch.randn(...))``) comes from
torch's global generator, seeded with ``seed`` before each run, and is plan-independent only
when the same tensors are real. Initialization runs on the CPU (values do not depend on the
device) and in the dtype the model was built with.
"""
from __future__ import annotations

import contextlib
import hashlib
from typing import Callable, Iterable

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

from .weights import CheckpointReader

aten = torch.ops.aten
_RANDOM_INPLACE = {aten.normal_, aten.uniform_, aten.bernoulli_, aten.random_, aten.exponential_,
                   aten.geometric_, aten.log_normal_, aten.cauchy_}


def tensor_seed(seed: int, fqn: str, count: int) -> int:
    digest = hashlib.sha256(f"{seed}\0{fqn}\0{count}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


class _PerTensorGenerators(TorchDispatchMode):
    """Every in-place random op on a tracked tensor (or a view of it) draws from a generator
    seeded from (seed, that tensor's FQN, its count of random ops so far)."""

    def __init__(self, seed: int, names: dict[int, str]):
        super().__init__()
        self.seed, self.names, self.counts = seed, names, {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func.overloadpacket in _RANDOM_INPLACE and args and isinstance(args[0], torch.Tensor) \
                and not args[0].is_meta:
            fqn = self.names.get(args[0].untyped_storage().data_ptr())
            if fqn is not None:
                n = self.counts.get(fqn, 0)
                self.counts[fqn] = n + 1
                gen = torch.Generator(device=args[0].device)
                gen.manual_seed(tensor_seed(self.seed, fqn, n))
                kwargs["generator"] = gen
        return func(*args, **kwargs)


def _slot(model: nn.Module, fqn: str) -> tuple[nn.Module, str, str]:
    """(owning module, attribute name, "param" | "buffer") of a tensor FQN."""
    path, _, attr = fqn.rpartition(".")
    mod = model.get_submodule(path) if path else model
    return mod, attr, "param" if attr in mod._parameters else "buffer"


def _get(model: nn.Module, fqn: str) -> torch.Tensor:
    mod, attr, kind = _slot(model, fqn)
    return (mod._parameters if kind == "param" else mod._buffers)[attr]


def assign(model: nn.Module, values: dict[str, torch.Tensor]) -> list:
    """Put ``values`` into the named slots of ``model`` (as Parameters where the slot holds a
    Parameter, keeping requires_grad; every name of a tied tensor gets the same new object);
    returns what was there, for ``restore``."""
    saved = []
    by_id: dict[int, torch.Tensor] = {}
    names: dict[int, list[str]] = {}
    for fqn, t in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(t), []).append(fqn)
    olds = {fqn: _get(model, fqn) for fqn in values}  # before any slot changes (tied names share one)
    for fqn, v in values.items():
        old = olds[fqn]
        if id(old) in by_id:  # another name of the same tensor came first: it is done
            continue
        new = nn.Parameter(v, requires_grad=old.requires_grad) if isinstance(old, nn.Parameter) else v
        by_id[id(old)] = new
        for name in names.get(id(old), [fqn]):
            mod, attr, kind = _slot(model, name)
            store = mod._parameters if kind == "param" else mod._buffers
            saved.append((store, attr, store[attr]))
            store[attr] = new
    return saved


def restore(saved: list) -> None:
    for store, attr, old in reversed(saved):
        store[attr] = old


@contextlib.contextmanager
def swapped(model: nn.Module, values: dict[str, torch.Tensor]):
    """``assign`` for the duration of the block."""
    saved = assign(model, values)
    try:
        yield
    finally:
        restore(saved)


def run_init(model: nn.Module, init_fn: Callable | None) -> None:
    """The model's initialization (see the module docstring): every module's
    ``reset_parameters()`` (what constructing it does: LayerNorm weights 1, ...), then
    ``init_fn(model)`` or ``model.init_weights()`` if there is one. Hugging Face models mark
    each module initialized and skip it the next time: the marks are cleared first, since every
    run initializes other tensors."""
    for m in model.modules():
        m.__dict__.pop("_is_hf_initialized", None)
        if callable(getattr(m, "reset_parameters", None)):
            m.reset_parameters()
    if init_fn is not None:
        init_fn(model)
    elif callable(getattr(model, "init_weights", None)):
        model.init_weights()


def has_init(model: nn.Module, init_fn) -> bool:
    return init_fn is not None or callable(getattr(model, "init_weights", None)) or any(
        callable(getattr(m, "reset_parameters", None)) for m in model.modules())


class Values:
    """Whole values of named tensors (FQNs of ``model.state_dict()``), a batch at a time."""

    def get(self, fqns: Iterable[str]) -> dict[str, torch.Tensor]:
        raise NotImplementedError


class LiveValues(Values):
    def __init__(self, model: nn.Module):
        self.model = model

    def get(self, fqns):
        return {f: _get(self.model, f).detach() for f in fqns}


class InitValues(Values):
    """Values the model's initialization gives, per tensor independent of which others exist.
    ``shapes``: each name's whole shape (before any module rewrite sharded it)."""

    def __init__(self, model: nn.Module, seed: int, init_fn: Callable | None, shapes: dict[str, tuple],
                 dtypes: dict[str, torch.dtype]):
        self.model, self.seed, self.init_fn, self.shapes, self.dtypes = model, seed, init_fn, shapes, dtypes

    def get(self, fqns):
        fqns = list(fqns)
        if not fqns:
            return {}
        fresh = {f: torch.zeros(self.shapes[f], dtype=self.dtypes[f]) for f in fqns}
        names = {t.untyped_storage().data_ptr(): f for f, t in fresh.items()}
        # every other tensor on meta for the run: the init must not touch values already given
        hidden = {f: torch.empty(t.shape, dtype=t.dtype, device="meta")
                  for f, t in _unique_tensors(self.model).items() if f not in fresh and not t.is_meta}
        with swapped(self.model, {**hidden, **fresh}), torch.no_grad(), torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            with _PerTensorGenerators(self.seed, names):
                run_init(self.model, self.init_fn)
            out = {f: _get(self.model, f).detach() for f in fqns}
        return out


class CheckpointValues(Values):
    """Tensors the checkpoint holds; the others (non-persistent buffers) from ``fallback``."""

    def __init__(self, reader: CheckpointReader, source_of: dict[str, str], fallback: Values | None,
                 dtypes: dict[str, torch.dtype]):
        self.reader, self.source_of, self.fallback, self.dtypes = reader, source_of, fallback, dtypes

    def get(self, fqns):
        fqns = list(fqns)
        out = {f: self.reader.read(self.source_of[f]).to(self.dtypes[f]) for f in fqns if f in self.source_of}
        rest = [f for f in fqns if f not in self.source_of]
        if rest:
            if self.fallback is None:
                raise ValueError(f"autopar: {rest[:4]} are not in {self.reader.describe} and the model has no "
                                 "initialization to compute them; give their module a reset_parameters() or "
                                 "the model an init_weights(), or pass init_fn=")
            out.update(self.fallback.get(rest))
        return out

    def rows(self, fqn: str, rows: slice) -> torch.Tensor | None:
        """Rows of dim 0 of a checkpoint tensor, reading only them (None if not stored)."""
        name = self.source_of.get(fqn)
        return None if name is None else self.reader.read(name, rows).to(self.dtypes[fqn])


def init_weights(model: nn.Module, seed: int = 0, init_fn: Callable | None = None,
                 device: torch.device | str = "cpu") -> nn.Module:
    """Give every parameter and buffer of ``model`` (built on the meta device, or not) the values
    ``autopar.parallelize(model, ..., seed=seed)`` initializes it with under every plan; in
    place, on ``device``; returns the model. This is the eager reference of autopar's init."""
    shapes = {f: tuple(t.shape) for f, t in model.state_dict(keep_vars=True).items()}
    dtypes = {f: t.dtype for f, t in model.state_dict(keep_vars=True).items()}
    canonical = list(_unique_tensors(model))
    values = InitValues(model, seed, init_fn, shapes, dtypes).get(canonical)
    assign(model, {f: v.to(device) for f, v in values.items()})
    return model


def _unique_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer once (a tied parameter under its first name)."""
    seen, out = set(), {}
    for fqn, t in list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            out[fqn] = t
    return out
