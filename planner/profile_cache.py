"""Model profiles cached on disk: the same model planned again skips its capture and unit traces.

``autopar plan`` on a preset or a Hugging Face config spends a few seconds capturing the model and
tracing its units before any search; for a given model those are always the same. A profile made
from a model on the meta device (costs from the graph alone: no unit timed on this machine) is
written to ``$AUTOPAR_CACHE_DIR/profiles/<key>.pkl`` (default ``~/.cache/autopar``), with the
context-parallel verdicts (``context_parallel_blocker``) of every cp it was asked for, and read
back by the next request on the same model.

The key (``profile_key``) is a SHA-256 over everything the profile depends on: the module tree
(each module's class, its ``extra_repr`` and the source of the file that defines the class), every
parameter and buffer (name, shape, dtype, trainable), a Hugging Face ``config`` when the model has
one, the example inputs' and target's shapes and dtypes, the loss function (its name and source
file), the profiling options (layer repeats, heads, experts, MoE config, dtype), the torch
version, and the source of autopar itself (every ``.py`` file of its packages): any change to
the model or to autopar's code gives another key, never a stale profile. A profile whose units
were timed on this machine (a real model on CPU) is never cached: its times are this run's.
An unreadable or mismatching file is ignored (a warning) and replaced; the folder keeps the
``KEEP`` most recently written profiles.
"""
from __future__ import annotations

import hashlib
import inspect
import logging
import os
import pickle
from dataclasses import replace
from functools import lru_cache

import torch

log = logging.getLogger("autopar")

FORMAT = 1
KEEP = 64  # profiles kept in the folder, the most recently written
_PACKAGES = ("autopar", "autopar.passes", "autopar.planner", "autopar.runtime", "autopar.parallel",
             "autopar.schedules")


def cache_path(key: str) -> str:
    from .devices import cache_dir

    return os.path.join(cache_dir(), "profiles", f"{key}.pkl")


@lru_cache(maxsize=1)
def _autopar_digest() -> str:
    import importlib

    h = hashlib.sha256()
    for name in _PACKAGES:
        pkg = importlib.import_module(name)
        for root in sorted(getattr(pkg, "__path__", [])):
            for fn in sorted(os.listdir(root)):
                if fn.endswith(".py"):
                    h.update(fn.encode())
                    with open(os.path.join(root, fn), "rb") as f:
                        h.update(f.read())
    return h.hexdigest()


@lru_cache(maxsize=1024)
def _file_digest(path: str | None) -> str:
    if not path or not os.path.exists(path):
        return "-"
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _source_of(obj) -> str:
    try:
        return _file_digest(inspect.getsourcefile(obj))
    except TypeError:  # a builtin
        return "builtin"


def _tensors_spec(x) -> str:
    from torch.utils._pytree import tree_leaves

    return repr([(tuple(t.shape), str(t.dtype)) if isinstance(t, torch.Tensor) else repr(t) for t in tree_leaves(x)])


def profile_key(model: torch.nn.Module, inputs, target, loss_fn, options: dict) -> str:
    """The cache key of ``model``'s profile (module docstring)."""
    h = hashlib.sha256()

    def feed(*parts):
        for p in parts:
            h.update(str(p).encode())
            h.update(b"\0")

    feed("format", FORMAT, torch.__version__, _autopar_digest())
    for name, mod in model.named_modules(remove_duplicate=False):
        cls = type(mod)
        feed("module", name, cls.__module__, cls.__qualname__, mod.extra_repr(), mod.training, _source_of(cls))
    for name, p in model.named_parameters(remove_duplicate=False):
        feed("param", name, tuple(p.shape), p.dtype, p.requires_grad)
    for name, b in model.named_buffers(remove_duplicate=False):
        feed("buffer", name, tuple(b.shape), b.dtype)
    config = getattr(model, "config", None)
    if config is not None:
        feed("config", config.to_json_string() if hasattr(config, "to_json_string") else repr(config))
    feed("inputs", _tensors_spec(inputs), "target", _tensors_spec(target))
    if loss_fn is not None:
        feed("loss", getattr(loss_fn, "__module__", ""), getattr(loss_fn, "__qualname__", repr(type(loss_fn))),
             _source_of(loss_fn if inspect.isfunction(loss_fn) or inspect.isclass(loss_fn) else type(loss_fn)))
    for k in sorted(options):
        feed("option", k, repr(options[k]))
    return h.hexdigest()


def load(key: str, cps: tuple[int, ...]):
    """(profile, {cp: verdict}) from the cache, or None when there is none for ``key`` or it
    lacks a verdict for one of ``cps``."""
    path = cache_path(key)
    if not os.path.exists(path):
        return None
    try:
        with open(path, "rb") as f:
            entry = pickle.load(f)
        if entry.get("format") != FORMAT or entry.get("key") != key:
            raise ValueError("written for another key or format")
    except Exception as e:  # noqa: BLE001 - any unreadable file is re-made
        log.warning("autopar: ignoring the unreadable profile cache %s (%s: %s)", path, type(e).__name__, e)
        return None
    verdicts = entry["cp_verdicts"]
    if any(cp not in verdicts for cp in cps):
        return None
    return entry["profile"], verdicts


def store(key: str, profile, verdicts: dict) -> str | None:
    """Write ``profile`` (without its captured graph) and the cp verdicts; returns the path, or
    None when the profile is not cacheable (units timed here) or the file cannot be written."""
    if profile.unit_timer is not None:
        return None
    path = cache_path(key)
    old = load(key, ())
    merged = {**(old[1] if old else {}), **verdicts}
    chunked = profile.chunked
    if chunked is not None:
        chunked = replace(chunked, captured=None, unit_timer=None, chunked=None, tp_variants={})
    entry = {"format": FORMAT, "key": key, "cp_verdicts": merged,
             "profile": replace(profile, captured=None, unit_timer=None, chunked=chunked, tp_variants={})}
    if not _write(path, entry, "profile cache"):
        return None
    _prune(os.path.dirname(path))
    return path


def _table_path(name: str) -> str:
    from .devices import cache_dir

    return os.path.join(cache_dir(), "tables", f"{name}-{_autopar_digest()[:16]}.pkl")


def load_table(name: str) -> dict:
    """A table of pure results of autopar's code (``name``: say, the schedules' in-flight counts
    by (schedule, pp, m, v)) as the last run of the same code left it; {} when there is none.
    The file name carries the code's digest: another version of autopar never reads it."""
    try:
        with open(_table_path(name), "rb") as f:
            table = pickle.load(f)
        return table if isinstance(table, dict) else {}
    except Exception:  # noqa: BLE001 - missing or unreadable: computed again
        return {}


def store_table(name: str, table: dict) -> None:
    """Write ``table`` for the next run of the same code (tables of other code versions go)."""
    path = _table_path(name)
    if not _write(path, table, "table cache"):
        return
    folder, mine = os.path.dirname(path), os.path.basename(path)
    try:
        for fn in os.listdir(folder):
            if fn.startswith(f"{name}-") and fn.endswith(".pkl") and fn != mine:
                os.remove(os.path.join(folder, fn))
    except OSError:
        pass


def _write(path: str, obj, what: str) -> bool:
    """Pickle ``obj`` to ``path`` atomically (a temporary file, then a rename); False, with a
    warning, when it cannot be written."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "wb") as f:
            pickle.dump(obj, f, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(tmp, path)
        return True
    except OSError as e:
        log.warning("autopar: could not write the %s %s: %s", what, path, e)
        return False


def _prune(folder: str, keep: int = KEEP) -> None:
    """Remove all but the ``keep`` most recently written profiles of ``folder`` (every change to
    autopar's code starts new keys: the old ones would pile up)."""
    try:
        files = [os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(".pkl")]
        for f in sorted(files, key=os.path.getmtime, reverse=True)[keep:]:
            os.remove(f)
    except OSError:
        pass
