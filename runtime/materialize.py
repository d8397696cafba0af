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

Non-persistent buffers (RoPE ``inv_freq``, BERT's ``position_ids``, Gemma's ``embed_scale``)
are in no checkpoint, and a module computes them in its constructor, which ran on the meta
device. ``buffer_values`` recomputes them, owner module by owner module, with the first of
these that writes them (each run with the buffers fresh and every other tensor on meta, writes
tracked by a dispatch mode):

1. a Hugging Face ``PreTrainedModel``: the nearest ``PreTrainedModel`` ancestor's
   ``_init_weights(owner)``, which is how transformers' ``from_pretrained`` restores them on a
   meta-built model (``_move_missing_keys_from_meta_to_device`` gives them storage, then
   ``initialize_weights`` runs ``_init_weights``: rotary modules' ``rope_init_fn``,
   ``position_ids``' arange, ...);
2. the owner's own ``reset_parameters()``;
3. the model's initialization (``init_fn`` or ``init_weights()``: torchtitan recomputes
   ``freqs_cis`` there);
4. a CPU twin of the owner, for an owner without parameters: its class constructed (on the CPU)
   from its attributes named like its ``__init__`` arguments (``config``, ``dim``, ...; the
   others take their defaults), its buffers read.

A buffer none of them computes is a ``ValueError`` naming it, its shape and the fix
(``check_materialized`` names any tensor still on meta after materialization the same way).
Tied parameters a checkpoint stores under one name are tied as the model declares them
(``declared_ties``: transformers' ``all_tied_weights_keys``, from ``tie_word_embeddings`` and
``_tied_weights_keys``) before the checkpoint is checked (``tie_declared``).
"""
from __future__ import annotations

import contextlib
import hashlib
import inspect
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

    def rows(self, fqn: str, rows: slice | tuple) -> torch.Tensor | None:
        """A block of a checkpoint tensor (rows of dim 0, or an index tuple of slices: a strided
        block of columns), reading only it (None if not stored)."""
        name = self.source_of.get(fqn)
        return None if name is None else self.reader.read(name, rows).to(self.dtypes[fqn])


def init_weights(model: nn.Module, seed: int = 0, init_fn: Callable | None = None,
                 device: torch.device | str = "cpu") -> nn.Module:
    """Give every parameter and buffer of ``model`` (built on the meta device, or not) the values
    ``autopar.parallelize(model, ..., seed=seed)`` initializes it with under every plan; in
    place, on ``device``; returns the model. This is the eager reference of autopar's init.
    Non-persistent buffers on meta are recomputed as ``buffer_values`` does."""
    shapes = {f: tuple(t.shape) for f, t in model.state_dict(keep_vars=True).items()}
    dtypes = {f: t.dtype for f, t in model.state_dict(keep_vars=True).items()}
    canonical = [f for f in _unique_tensors(model) if f in shapes]
    buffers = buffer_values(model, seed=seed, init_fn=init_fn)
    values = InitValues(model, seed, init_fn, shapes, dtypes).get(canonical)
    assign(model, {f: v.to(device) for f, v in {**values, **buffers}.items()})
    return model


def _unique_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer once (a tied parameter under its first name)."""
    seen, out = set(), {}
    for fqn, t in list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            out[fqn] = t
    return out


# -- non-persistent buffers, tied weights, what is left on meta --------------------------------


def non_persistent_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """FQN -> buffer for every buffer ``model.state_dict()`` leaves out (``persistent=False``)."""
    persistent = set(model.state_dict(keep_vars=True))
    return {f: b for f, b in model.named_buffers() if f not in persistent}


class _Writes(TorchDispatchMode):
    """The storages every op writes (arguments its schema marks as written: in-place and out=)."""

    def __init__(self):
        super().__init__()
        self.written: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for i, arg in enumerate(func._schema.arguments):
            if arg.alias_info is not None and arg.alias_info.is_write:
                v = args[i] if i < len(args) else kwargs.get(arg.name)
                if isinstance(v, torch.Tensor) and not v.is_meta:
                    self.written.add(v.untyped_storage().data_ptr())
        return func(*args, **kwargs)


def _run_fresh(model: nn.Module, fqns: list[str], fn: Callable, seed: int) -> dict[str, torch.Tensor]:
    """Run ``fn()`` with the tensors ``fqns`` fresh (zeros on the CPU, their shapes and dtypes) and
    every other tensor on meta, on the CPU, without touching torch's generators; returns what it
    wrote of them (in place, or by putting a new tensor in the slot)."""
    fresh = {f: torch.zeros(_get(model, f).shape, dtype=_get(model, f).dtype) for f in fqns}
    names = {t.untyped_storage().data_ptr(): f for f, t in fresh.items()}
    hidden = {f: torch.empty(t.shape, dtype=t.dtype, device="meta")
              for f, t in _unique_tensors(model).items() if f not in fresh and not t.is_meta}
    writes = _Writes()
    out = {}
    with swapped(model, {**hidden, **fresh}), torch.no_grad(), torch.random.fork_rng(devices=[]), \
            torch.device("cpu"):
        torch.manual_seed(seed)
        with _PerTensorGenerators(seed, names), writes:
            fn()
        for f, t in fresh.items():
            now = _get(model, f)
            if now is not t:  # the slot was given a new tensor (self.freqs = compute(...))
                if isinstance(now, torch.Tensor) and not now.is_meta and tuple(now.shape) == tuple(t.shape):
                    out[f] = now.detach().to(t.dtype)
            elif t.numel() == 0 or t.untyped_storage().data_ptr() in writes.written:
                out[f] = t
    return out


def _pretrained_owner(model: nn.Module, path: str):
    """The nearest Hugging Face ``PreTrainedModel`` at or above the module at ``path``."""
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return None
    parts = path.split(".") if path else []
    for n in range(len(parts), -1, -1):
        mod = model.get_submodule(".".join(parts[:n]))
        if isinstance(mod, PreTrainedModel):
            return mod
    return None


def _twin(module: nn.Module, names: list[str], seed: int) -> tuple[dict[str, torch.Tensor], str]:
    """The buffers ``names`` of a CPU twin of ``module`` (its class constructed from its attributes
    named like its ``__init__`` arguments), or ({}, why not)."""
    cls = type(module)
    if any(True for _ in module.parameters()):
        return {}, f"a CPU twin of {cls.__name__} is not built because it has parameters"
    try:
        sig = inspect.signature(cls.__init__)
    except (TypeError, ValueError):
        return {}, f"{cls.__name__}.__init__ has no signature to build a CPU twin from"
    args, kwargs, attrs = [], {}, vars(module)
    for name, p in list(sig.parameters.items())[1:]:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if name == "device":
            value = torch.device("cpu")
        elif name in attrs:
            value = attrs[name]
        elif p.default is not p.empty:
            continue
        else:
            return {}, (f"a CPU twin of {cls.__name__} cannot be built: its __init__ argument {name!r} is not an "
                        "attribute of the module")
        (args.append(value) if p.kind == p.POSITIONAL_ONLY else kwargs.__setitem__(name, value))
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]), torch.device("cpu"):
            torch.manual_seed(seed)
            twin = cls(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - the reason goes into the caller's ValueError
        return {}, f"a CPU twin of {cls.__name__} failed to build ({type(e).__name__}: {e})"
    out = {}
    for name in names:
        b = twin._buffers.get(name)
        mine = module._buffers[name]
        if isinstance(b, torch.Tensor) and not b.is_meta and tuple(b.shape) == tuple(mine.shape):
            out[name] = b.detach().to(mine.dtype)
    return out, "" if len(out) == len(names) else f"a CPU twin of {cls.__name__} has no buffer of that shape"


def buffer_values(model: nn.Module, *, seed: int = 0, init_fn: Callable | None = None,
                  fqns: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
    """Values (on the CPU) of the non-persistent buffers on the meta device (or of ``fqns``),
    computed the way their modules compute them (the module docstring's four ways, the first that
    writes them); ValueError naming each one that none computes, with its shape and the fix."""
    todo = [f for f, b in non_persistent_buffers(model).items() if b.is_meta] if fqns is None else list(fqns)
    by_owner: dict[str, list[str]] = {}
    for f in todo:
        by_owner.setdefault(f.rpartition(".")[0], []).append(f)
    out: dict[str, torch.Tensor] = {}
    why: dict[str, list[str]] = {}

    def attempt(fs: list[str], fn: Callable, what: str) -> None:
        fs = [f for f in fs if f not in out]
        if not fs:
            return
        try:
            out.update(_run_fresh(model, fs, fn, seed))
        except Exception as e:  # noqa: BLE001 - a hook that fails is one way less; the reason is reported
            for f in fs:
                why.setdefault(f, []).append(f"{what} failed ({type(e).__name__}: {e})")

    for path, fs in by_owner.items():
        owner = model.get_submodule(path)
        pretrained = _pretrained_owner(model, path)
        if pretrained is not None and callable(getattr(pretrained, "_init_weights", None)):
            attempt(fs, lambda p=pretrained, o=owner: p._init_weights(o), f"{type(pretrained).__name__}._init_weights")
        if callable(getattr(owner, "reset_parameters", None)):
            attempt(fs, owner.reset_parameters, f"{type(owner).__name__}.reset_parameters()")
    left = [f for f in todo if f not in out]
    if left and (init_fn is not None or callable(getattr(model, "init_weights", None))):
        attempt(left, lambda: run_init(model, init_fn), "the model's init")
    for path, fs in by_owner.items():
        fs = [f for f in fs if f not in out]
        if fs:
            got, reason = _twin(model.get_submodule(path), [f.rpartition(".")[2] for f in fs], seed)
            out.update({f: got[f.rpartition(".")[2]] for f in fs if f.rpartition(".")[2] in got})
            for f in fs:
                if f not in out:
                    why.setdefault(f, []).append(reason)
    left = [f for f in todo if f not in out]
    if left:
        shown = "; ".join(f"{f} (shape {tuple(_get(model, f).shape)}, {_get(model, f).dtype}, in "
                          f"{type(_slot(model, f)[0]).__name__}: " + "; ".join(why.get(f, [])) + ")" for f in left[:4])
        raise ValueError(f"autopar: {len(left)} non-persistent buffer(s) are on the meta device and nothing computes "
                         f"them: {shown}. A checkpoint never holds them, and their module computed them in its "
                         "constructor, on meta. Build that module on the CPU (outside the meta-device block), give it "
                         "a reset_parameters() that fills them, or pass init_fn= that sets them")
    return {f: out[f] for f in todo}


def check_materialized(model: nn.Module, fqns: Iterable[str]) -> None:
    """ValueError naming every tensor of ``fqns`` (parameters or buffers) still on the meta device
    (raised before the executor exists, so before any program or collective runs)."""
    left = [f for f in fqns if _get(model, f).is_meta]
    if left:
        shown = ", ".join(f"{f} (shape {tuple(_get(model, f).shape)})" for f in left[:6])
        raise ValueError(f"autopar: {len(left)} tensor(s) this process's stages read are still on the meta device "
                         f"after materialization: {shown}. Pass weights= holding them (keys as in "
                         "model.state_dict()), or give their modules an initialization (reset_parameters(), the "
                         "model's init_weights(), or init_fn=) that fills them")


def declared_ties(model: nn.Module) -> dict[str, str]:
    """{tied parameter: the parameter it is tied to} as the model declares them: transformers'
    ``all_tied_weights_keys`` (expanded from ``_tied_weights_keys``, empty when the config says
    ``tie_word_embeddings=False``), else a ``_tied_weights_keys`` dict when the config (if any)
    ties word embeddings."""
    keys = getattr(model, "all_tied_weights_keys", None)
    if keys is None and callable(getattr(model, "get_expanded_tied_weights_keys", None)):
        keys = model.get_expanded_tied_weights_keys(all_submodels=True)
    if keys is None:
        declared = getattr(model, "_tied_weights_keys", None)
        tie = getattr(getattr(model, "config", None), "tie_word_embeddings", True)
        keys = declared if isinstance(declared, dict) and tie else {}
    return dict(keys)


def tie_declared(model: nn.Module, present: set[str]) -> list[tuple[str, str]]:
    """Tie the declared ties (``declared_ties``) that are not tied in ``model`` and that a
    checkpoint holding ``present`` stores under one name only, the way transformers'
    ``tie_weights`` does in ``from_pretrained``: the absent name gets the stored one's parameter.
    Returns the (absent, stored) pairs tied."""
    params = dict(model.named_parameters(remove_duplicate=False))
    done = []
    for target, source in declared_ties(model).items():
        if target not in params or source not in params or params[target] is params[source]:
            continue
        if target not in present and source in present:
            absent, stored = target, source
        elif source not in present and target in present:
            absent, stored = source, target
        else:
            continue
        if tuple(params[absent].shape) != tuple(params[stored].shape):
            continue
        mod, attr, _ = _slot(model, absent)
        mod._parameters[attr] = params[stored]
        params[absent] = params[stored]
        done.append((absent, stored))
    return done
