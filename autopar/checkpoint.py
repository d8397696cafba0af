"""Checkpoints with torch.distributed.checkpoint (DCP): ``pm.save(dir)``, ``pm.load(dir)`` under
any plan, and ``export(dir, out)`` to safetensors (docs/checkpoints.md).

What a checkpoint holds, under the model's own names and shapes whatever the plan:

  model.<fqn>               every parameter (its fp32 master under mixed precision) and
                            persistent buffer, whole shape; a tied parameter once, under its
                            first name (``autopar.meta`` lists the others)
  optim.state.<fqn>.<name>  the optimizer's state: per-element tensors (AdamW's exp_avg,
                            exp_avg_sq) with the parameter's shape, scalars (step) 0-dim
  autopar.meta              (rank 0) format version, ``pm.step_count``, plan, world size, aliases
  autopar.rank<r>           (rank r) its RNG states (torch CPU, CUDA when initialized) and the
                            param_groups options (lr, initial_lr, betas, ...) of what it trains

How shards map (no tensor is gathered, nothing moves between ranks): every tensor is seen as
its flat row-major elements, and each parallelism owner says which flat ranges this process
holds (``local_shards``, parallel/base.Shard): DataParallel its fp32 masters and ZeRO-1/2/3
shards (and the tensor the optimizer steps, whose per-element state has the same layout),
ExpertParallel where its expert rows lie in the whole tensor, PipelineParallel which pipeline
rank holds the primary copy of a tensor several hold (tied weights). A tensor-parallel block
(parallel/tensor.py) is mapped in its own coordinates, each box shifted to where the block lies
in the whole tensor (``TpShard.whole_boxes``: one box per packed part); what every tp rank holds
alike is written in tp parts, like replicas. A flat range of a
row-major tensor is at most 2*ndim-1 boxes, each contiguous in memory; each box is one DCP
chunk, a view of the live tensor. Every element is written exactly once (DCP's plan check
fails the save otherwise): ZeRO shards are disjoint, a range that R replicas hold whole is cut
in R parts and each writes one, a tensor several pipeline ranks hold is written by its owner,
a buffer by replica 0 (replicas may differ: BatchNorm statistics), a scalar state by the
process that writes element 0 of its parameter.

Loading reshards by DCP's chunk overlap: every rank asks for exactly the boxes it holds under
its own plan (its masters and shards, their optimizer state, and the whole copies its
programs read: ZeRO-1/2 parameters, ZeRO-3's resident group, mixed precision's compute copies,
cast on the way in) and reads them in place.

A half-written checkpoint never looks complete: DCP writes each rank's data files first and
the ``.metadata`` file last (to a temporary name, then renamed), after every rank reported
success; ``save`` into an existing checkpoint deletes its ``.metadata`` before anything is
written. ``load`` and ``export`` of a directory without ``.metadata`` raise a ValueError
naming it.
"""
from __future__ import annotations

import contextlib
import glob
import json
import logging
import math
import os
import warnings
from dataclasses import dataclass, replace

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from autopar.muon import LAYOUT_OPTIONS
from autopar.parallel.base import Shard

log = logging.getLogger("autopar")

FORMAT = 1
MODEL, STATE, META, RANK = "model.", "optim.state.", "autopar.meta", "autopar.rank"
METADATA = ".metadata"  # DCP's index, written last


# -- flat ranges as boxes ----------------------------------------------------------------------


def boxes(shape: tuple[int, ...], lo: int, hi: int) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
    """Elements ``[lo, hi)`` of a row-major tensor of ``shape`` as boxes ``(offsets, sizes,
    first flat index)``, in flat order; each box is contiguous (only its leading dim is partial),
    at most 2*ndim-1 of them. A 0-dim tensor is one box of no dims."""
    if lo >= hi:
        return []
    if not shape:
        return [((), (), 0)]
    inner = math.prod(shape[1:])
    rest = tuple(shape[1:])
    out = []

    def partial_row(r: int, a: int, b: int) -> None:  # elements [a, b) of row r, a row's own coordinates
        out.extend(((r, *o), (1, *s), r * inner + f) for o, s, f in boxes(rest, a, b))

    if lo % inner:
        r = lo // inner
        end = min(hi, (r + 1) * inner)
        partial_row(r, lo - r * inner, end - r * inner)
        lo = end
    r0, r1 = lo // inner, hi // inner
    if lo < hi and r1 > r0:
        out.append(((r0,) + (0,) * len(rest), (r1 - r0, *rest), r0 * inner))
        lo = r1 * inner
    if lo < hi:
        partial_row(lo // inner, 0, hi - (lo // inner) * inner)
    return out


@dataclass
class _Piece:
    """Elements [lo, hi) of checkpoint tensor ``key`` (whole shape ``shape``) are ``flat``
    here: 1-D, a view of live storage (or of a copy of a non-contiguous tensor: ``back``)."""

    key: str
    shape: tuple[int, ...]
    lo: int
    hi: int
    flat: torch.Tensor
    back: tuple[torch.Tensor, torch.Tensor] | None = None  # (live tensor, the copy ``flat`` views)
    # a tensor-parallel block (passes/tensor_parallel.TpShard): ``shape``, ``lo`` and ``hi`` are
    # in the block's coordinates and each box maps to boxes of the whole tensor
    tp: object = None

    @property
    def whole_shape(self) -> tuple[int, ...]:
        return self.shape if self.tp is None else tuple(self.tp.full_shape)

    def chunks(self) -> list[tuple[tuple[int, ...], tuple[int, ...], torch.Tensor]]:
        local = [(off, size, self.flat[first - self.lo: first - self.lo + math.prod(size)].view(size))
                 for off, size, first in boxes(self.shape, self.lo, self.hi)]
        return local if self.tp is None else [c for box in local for c in self.tp.whole_boxes(*box)]


def _flat(t: torch.Tensor, start: int, n: int) -> tuple[torch.Tensor, tuple | None]:
    """Elements [start, start + n) of ``t``'s row-major elements: a view when ``t`` is
    contiguous, else a view of a copy, with (``t``, the copy) to write it back after a load."""
    if t.is_contiguous():
        return t.detach().view(-1)[start: start + n], None
    copy = t.detach().reshape(-1).clone()
    return copy[start: start + n], (t, copy)


# -- what this process holds --------------------------------------------------------------------


@dataclass
class _Held:
    fqn: str
    shard: Shard   # in the whole tensor's coordinates (a tp shard: in its block's)
    role: str      # "value" (written), "buffer" (written by replica 0), "mirror" (a copy programs read: loaded)
    tp: object = None  # the TpShard of a tensor-parallel block


def _holdings(built, model) -> list[_Held]:
    """Every piece of every model tensor this process holds, from the owners' shard maps."""
    pp, dp, ep = built.parallelisms["pp"], built.parallelisms["dp"], built.parallelisms.get("ep")
    mesh = built.mesh
    replicas, replica = (mesh.replicas, mesh.replica) if mesh is not None else (1, 0)
    placed = {f: s[0] for f, s in ep.local_shards().items()} if ep is not None else {}

    def whole(f: str, s: Shard) -> Shard:  # an expert shard's coordinates -> the whole tensor's
        e = placed.get(f)
        return s if e is None else replace(s, lo=e.lo + s.lo, hi=e.lo + s.hi, shape=e.shape)

    out: list[_Held] = []
    trained = dp.local_shards()
    for f in dp.trained:  # a parameter of this pipeline rank, maybe with no element in this replica's shard
        shards = trained.get(f, [])
        out += [_Held(f, whole(f, s), "value") for s in shards]
        live = built.params[f]
        if live.numel() and not live.is_meta and all(s.source is not live for s in shards):
            out.append(_Held(f, whole(f, Shard(0, live.numel(), tuple(live.shape), live)), "mirror"))
    held = set().union(*pp.held(built.stages)) if mesh is not None else None
    stepped = set(dp.trained)
    for name, t in model.state_dict(keep_vars=True).items():
        f = pp.canonical.get(name, name)
        if f != name or f in stepped or t.is_meta or t.numel() == 0:
            continue
        if held is not None and f not in held and f in pp.owner_of:
            continue  # another pipeline rank's tensor (a model built whole keeps a stale copy)
        if f in built.params:  # a parameter nothing trains here: whole on every replica
            copies, copy = (mesh.expert_replicas, mesh.expert_replica) if f in placed else (replicas, replica)
            out.append(_Held(f, whole(f, Shard(0, t.numel(), tuple(t.shape), t, copies=copies, copy=copy)), "value"))
        else:
            out.append(_Held(f, Shard(0, t.numel(), tuple(t.shape), t), "buffer"))
    tp = built.parallelisms.get("tp")
    if tp is None:
        return out
    # tensor parallelism: a block is this tp rank's alone, and so are experts folded over the tp
    # ranks (their copies already count them: mesh.expert_replicas); anything else every tp rank
    # holds alike, so each writes its part of it (tp more copies)
    t, r = mesh.tp, mesh.tp_rank
    return [replace(h, tp=tp.shards[h.fqn]) if h.fqn in tp.shards
            else h if mesh.folded and h.fqn in placed
            else replace(h, shard=replace(h.shard, copies=h.shard.copies * t, copy=h.shard.copy * t + r))
            for h in out]


def _is_elementwise(v, source: torch.Tensor) -> bool:
    return torch.is_tensor(v) and tuple(v.shape) == tuple(source.shape)


def _covers_whole(s: Shard) -> bool:
    return s.lo == 0 and s.hi == math.prod(s.shape)


# -- save -----------------------------------------------------------------------------------------


def save(pm, path: str) -> None:
    """Write a checkpoint of ``pm`` to directory ``path`` (collective: every rank calls it).

    Each rank writes only what it owns (module docstring): its shards of the parameters (fp32
    masters under mixed precision), of the optimizer's state, its part of what replicas hold
    whole, plus ``pm.step_count``, its RNG states and param_groups options; nothing is
    gathered. A save that does not finish leaves no ``.metadata`` file in ``path``: ``load``
    refuses the directory with a ValueError, and an earlier checkpoint elsewhere is untouched."""
    built = pm.built
    path = os.fspath(path)
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"autopar: checkpoint path {path} exists and is not a directory")
    mesh = built.mesh
    rank = mesh.rank if mesh is not None else 0
    opt = built.optimizer  # state and param_groups keyed by the Shard sources (a WrappedOptimizer: the inner's)
    pp = built.parallelisms["pp"]
    pieces: list[_Piece] = []
    blobs: dict[str, object] = {}
    options: dict[str, dict] = {}
    group_of = {id(p): g for g in (opt.param_groups if opt is not None else []) for p in g["params"]}
    for h in _holdings(built, pm.model):
        s = h.shard
        if h.role == "value" and id(s.source) in group_of:
            options[h.fqn] = {k: v for k, v in group_of[id(s.source)].items()
                              if k != "params" and k not in LAYOUT_OPTIONS}
        if h.role == "mirror" or not pp.is_owner(h.fqn):
            continue
        if h.role == "buffer" and mesh is not None and (mesh.replica != 0 or mesh.tp_rank != 0):
            continue
        n = s.hi - s.lo
        lo, hi = (s.lo, s.hi) if h.role == "buffer" else (s.lo + n * s.copy // s.copies,
                                                          s.lo + n * (s.copy + 1) // s.copies)
        if lo >= hi:
            continue
        start = s.start + lo - s.lo
        pieces.append(_Piece(MODEL + h.fqn, s.shape, lo, hi, _flat(s.source, start, hi - lo)[0], tp=h.tp))
        state = opt.state.get(s.source, {}) if opt is not None and h.role == "value" else {}
        for name, v in state.items():
            key = f"{STATE}{h.fqn}.{name}"
            if _is_elementwise(v, s.source):
                pieces.append(_Piece(key, s.shape, lo, hi, _flat(v, start, hi - lo)[0], tp=h.tp))
            elif lo != 0 or (h.tp is not None and h.tp.rank != 0):
                continue  # a scalar: written by the process that writes element 0 (of tp block 0)
            elif torch.is_tensor(v) and (v.dim() == 0 or _covers_whole(s)):
                pieces.append(_Piece(key, tuple(v.shape), 0, max(v.numel(), 1), v.detach().reshape(-1)))
            elif torch.is_tensor(v):
                raise ValueError(f"autopar: optimizer state {name!r} of {h.fqn} has shape {tuple(v.shape)}, neither "
                                 f"the shape of what the optimizer steps ({tuple(s.source.shape)}) nor a scalar: a "
                                 "checkpoint cannot reshard it; use ZeRO-0 for this optimizer")
            else:
                blobs[key] = v
    if rank == 0:
        blobs[META] = {"format": FORMAT, "step_count": pm.step_count, "plan": built.plan.to_json(),
                       "world": mesh.world if mesh is not None else 1,
                       "aliases": {k: list(v) for k, v in built.captured.aliases.items()},
                       "mixed_precision": repr(built.parallelisms["dp"].precision)}
    blobs[f"{RANK}{rank}"] = {"rng": _rng_state(), "param_groups": options}
    if rank == 0:
        _clear(path)  # before any rank writes: the plan exchange inside dcp.save waits for rank 0
    os.makedirs(path, exist_ok=True)
    with _single_process_quiet():
        dcp.save({}, storage_writer=FileSystemWriter(path), planner=_SavePlanner(pieces, blobs), no_dist=mesh is None)
    log.info("autopar: rank %d saved %d tensor pieces (%.1f MiB) to %s", rank, len(pieces),
             sum(p.flat.numel() * p.flat.element_size() for p in pieces) / 2**20, path)


@contextlib.contextmanager
def _single_process_quiet():
    """DCP warns that it assumes one process when no process group exists: local mode means it."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _clear(path: str) -> None:
    """An earlier checkpoint in ``path`` stops looking complete (its index first), then goes."""
    index = os.path.join(path, METADATA)
    if os.path.exists(index):
        os.remove(index)
    for f in glob.glob(os.path.join(path, "__*_*.distcp")):
        os.remove(f)


def _rng_state() -> dict:
    cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return {"cpu": torch.get_rng_state(), "cuda": cuda}


def _path_of(key: str) -> tuple[str, ...]:
    """Where DCP's flattening would put ``key`` (so ``dcp_to_torch_save`` nests it as
    {"model": {fqn: ...}, "optim": {"state": {fqn: {name: ...}}}})."""
    if key.startswith(MODEL):
        return ("model", key[len(MODEL):])
    if key.startswith(STATE):
        fqn, name = key[len(STATE):].rsplit(".", 1)
        return ("optim", "state", fqn, name)
    return tuple(key.split(".", 1))


class _SavePlanner(DefaultSavePlanner):
    """DCP's default global planning (metadata, the every-element-once check); the local plan
    is ours: each piece's boxes as chunks of the whole tensor, views of live storage."""

    def __init__(self, pieces: list[_Piece], blobs: dict[str, object]):
        super().__init__()
        self.chunks = {(p.key, off): t for p in pieces for off, _size, t in p.chunks()}
        self.shapes = {p.key: p.whole_shape for p in pieces}
        self.blobs = blobs

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator: bool = False) -> None:
        self.state_dict, self.is_coordinator = state_dict, is_coordinator
        self.mappings = {k: _path_of(k) for k in [*self.shapes, *self.blobs]}

    def create_local_plan(self) -> SavePlan:
        items = [WriteItem(index=MetadataIndex(key, torch.Size(off)), type=WriteItemType.SHARD,
                           tensor_data=TensorWriteData(
                               chunk=ChunkStorageMetadata(offsets=torch.Size(off), sizes=t.shape),
                               properties=TensorProperties(dtype=t.dtype), size=torch.Size(self.shapes[key])))
                 for (key, off), t in self.chunks.items()]
        items += [WriteItem(index=MetadataIndex(key), type=WriteItemType.BYTE_IO) for key in self.blobs]
        self.plan = SavePlan(items, planner_data=self.mappings)
        return self.plan

    def lookup_object(self, index: MetadataIndex):
        if index.fqn in self.blobs:
            return self.blobs[index.fqn]
        return self.chunks[(index.fqn, tuple(index.offset))]


# -- load -----------------------------------------------------------------------------------------


def read_metadata(path: str):
    """DCP's metadata of the checkpoint in ``path``; ValueError when there is none (a missing
    directory, or a save that did not finish: its ``.metadata`` is written last)."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise ValueError(f"autopar: no checkpoint at {path}: not a directory")
    if not os.path.exists(os.path.join(path, METADATA)):
        raise ValueError(f"autopar: {path} is not a complete checkpoint: it has no {METADATA} file (DCP writes it "
                         "last, once every rank wrote its data), so a save into it was interrupted or is still "
                         "running; load an earlier checkpoint")
    try:
        md = FileSystemReader(path).read_metadata()
    except Exception as e:  # noqa: BLE001 - any unreadable index is the same problem to the user
        raise ValueError(f"autopar: {path}/{METADATA} cannot be read ({type(e).__name__}: {e})") from e
    if META not in md.state_dict_metadata:
        raise ValueError(f"autopar: {path} is a torch.distributed.checkpoint directory but not one written by "
                         "autopar's save (no autopar.meta)")
    return md


def load(pm, path: str) -> None:
    """Read the checkpoint in ``path`` into ``pm`` under its own plan (collective): parameters,
    masters, optimizer state, param_groups options, ``pm.step_count``, this rank's RNG states.
    ValueError for a missing or incomplete directory, or one that does not fit the model."""
    built = pm.built
    path = os.fspath(path)
    md = read_metadata(path)
    mesh = built.mesh
    rank = mesh.rank if mesh is not None else 0
    opt = built.optimizer
    holdings = _holdings(built, pm.model)
    saved = md.state_dict_metadata
    _check_fit(_whole_shapes(built, pm.model), saved, path)
    with_state = {k[len(STATE):].rsplit(".", 1)[0] for k in saved if k.startswith(STATE)}
    if opt is not None:
        _init_optimizer_state(getattr(opt, "inner", opt))
    pieces: list[_Piece] = []
    scalars: dict[str, tuple[dict, str]] = {}  # checkpoint key of a non-tensor state -> (state, name)
    first_fqn: dict[int, str] = {}  # id(source) -> the fqn whose scalar states it takes
    fresh: list = []  # sources whose optimizer state the checkpoint does not have
    for h in holdings:
        s = h.shard
        flat, back = _flat(s.source, s.start, s.hi - s.lo)
        pieces.append(_Piece(MODEL + h.fqn, s.shape, s.lo, s.hi, flat, back, tp=h.tp))
        state = opt.state.get(s.source) if opt is not None and h.role == "value" else None
        if not state:
            continue
        if h.fqn not in with_state:
            fresh.append(s.source)
            continue
        owner = first_fqn.setdefault(id(s.source), h.fqn)
        for name, v in state.items():
            if _is_elementwise(v, s.source):
                flat, back = _flat(v, s.start, s.hi - s.lo)
                pieces.append(_Piece(f"{STATE}{h.fqn}.{name}", s.shape, s.lo, s.hi, flat, back, tp=h.tp))
            elif owner != h.fqn:
                continue
            elif torch.is_tensor(v) and (v.dim() == 0 or _covers_whole(s)):
                flat, back = _flat(v, 0, v.numel())
                pieces.append(_Piece(f"{STATE}{owner}.{name}", tuple(v.shape), 0, max(v.numel(), 1), flat, back))
            elif torch.is_tensor(v):
                raise ValueError(f"autopar: optimizer state {name!r} of {h.fqn} has shape {tuple(v.shape)}: it cannot "
                                 "be resharded; use ZeRO-0 for this optimizer")
            else:
                scalars[f"{STATE}{owner}.{name}"] = (state, name)
    if fresh:
        log.warning("autopar: %s has no optimizer state for %d of the tensors this rank steps: theirs starts fresh",
                    path, len({id(t) for t in fresh}))
    for source in fresh:
        opt.state.pop(source, None)
    ranks = [k for k in saved if k.startswith(RANK)]
    planner = _LoadPlanner(pieces, [META, *ranks, *scalars], path)
    try:
        with _single_process_quiet():
            dcp.load({}, storage_reader=FileSystemReader(path), planner=planner, no_dist=mesh is None)
    except dcp.CheckpointException as e:  # a rank's ValueError, reported to every rank by DCP
        for err in e.failures.values():
            first = err[0] if isinstance(err, tuple) else err
            if isinstance(first, ValueError):
                raise ValueError(str(first)) from None
        raise
    with torch.no_grad():
        for p in pieces:
            if p.back is not None:
                live, copy = p.back
                live.copy_(copy.view(live.shape))
    for key, (state, name) in scalars.items():
        state[name] = planner.blobs[key]
    meta = planner.blobs[META]
    pm.step_count = meta["step_count"]
    if opt is not None:
        _apply_options(opt, holdings, planner.blobs, ranks)
    mine = planner.blobs.get(f"{RANK}{rank}")
    if mine is not None:
        _set_rng_state(mine["rng"])
    elif rank:
        log.info("autopar: rank %d has no RNG state in %s (saved by %d ranks): it keeps its own", rank, path,
                 meta["world"])
    built.parallelisms["dp"].loaded()
    log.info("autopar: rank %d loaded %s (step %d, saved under %s by %d ranks)", rank, path, pm.step_count,
             meta["plan"], meta["world"])


def _whole_shapes(built, model) -> dict[str, tuple[int, ...]]:
    """Canonical FQN -> whole shape of every model tensor, alike on every rank: an expert
    shard's full shape, a ZeRO-3 parameter's from its group (its live tensor is freed)."""
    pp, dp, ep = built.parallelisms["pp"], built.parallelisms["dp"], built.parallelisms.get("ep")
    shapes = {pp.canonical.get(n, n): tuple(t.shape) for n, t in model.state_dict(keep_vars=True).items()}
    if dp.storage is not None:
        shapes.update({f: tuple(shape) for g in dp.storage.groups for f, shape in zip(g.fqns, g.shapes)})
    if ep is not None:
        shapes.update({f: tuple(sh.full_shape) for f, sh in ep.shards.items()})
    if "tp" in built.parallelisms:
        shapes.update({f: tuple(sh.full_shape) for f, sh in built.parallelisms["tp"].shards.items()})
    return shapes


def _check_fit(shapes: dict, saved: dict, path: str) -> None:
    """ValueError (on every rank alike, before any communication) when the checkpoint's model
    tensors are not the model's: names and whole shapes."""
    have = {k[len(MODEL):]: tuple(v.size) for k, v in saved.items()
            if k.startswith(MODEL) and isinstance(v, TensorStorageMetadata)}
    missing, unexpected = sorted(set(shapes) - set(have)), sorted(set(have) - set(shapes))
    wrong = [f"{f}: {have[f]} in the checkpoint, {shapes[f]} in the model" for f in shapes
             if f in have and have[f] != shapes[f]]
    problems = ([f"{len(missing)} missing key(s), e.g. {missing[:4]}"] if missing else []) + (
        [f"{len(unexpected)} unexpected key(s), e.g. {unexpected[:4]}"] if unexpected else []) + (
        [f"{len(wrong)} shape mismatch(es): " + "; ".join(wrong[:4])] if wrong else [])
    if problems:
        raise ValueError(f"autopar: the checkpoint in {path} does not fit the model: " + "; ".join(problems)
                         + " (it was saved from another architecture or configuration)")


def _init_optimizer_state(opt) -> None:
    """Create the optimizer's state for every parameter that has none, so a checkpoint can be
    read into it in place: one step with zero gradients and lr 0 (torch's own approach in
    torch.distributed.checkpoint.state_dict); the values are overwritten by the load."""
    params = [p for g in opt.param_groups for p in g["params"] if p.requires_grad]
    if all(opt.state.get(p) for p in params):
        return
    grads = [p.grad for p in params]
    lrs = [g.get("lr") for g in opt.param_groups]
    for p in params:
        p.grad = torch.zeros_like(p)
    for g in opt.param_groups:
        if "lr" in g:
            g["lr"] = torch.zeros_like(g["lr"]) if torch.is_tensor(g["lr"]) else 0.0
    opt.step()  # what it changes of the parameters (nothing at lr 0 for torch's optimizers) is read anew
    for p, grad in zip(params, grads):
        p.grad = grad
    for g, lr in zip(opt.param_groups, lrs):
        if lr is not None:
            g["lr"] = lr


def _apply_options(opt, holdings: list[_Held], blobs: dict, ranks: list[str]) -> None:
    """Each param group takes the saved options (lr, initial_lr, betas, ...) of its parameters."""
    saved: dict[str, dict] = {}
    for r in ranks:
        saved.update(blobs[r]["param_groups"])
    fqns: dict[int, list[str]] = {}
    for h in holdings:
        if h.role == "value":
            fqns.setdefault(id(h.shard.source), []).append(h.fqn)
    for group in opt.param_groups:
        names = [f for p in group["params"] for f in fqns.get(id(p), [])]
        options = next((saved[f] for f in names if f in saved), None)
        if options is not None:
            group.update({k: v for k, v in options.items() if k not in LAYOUT_OPTIONS})


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["cpu"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _narrow(t: torch.Tensor, offsets, lengths) -> torch.Tensor:
    for d, (o, n) in enumerate(zip(offsets, lengths)):
        t = t.narrow(d, o, n)
    return t


class _LoadPlanner(DefaultLoadPlanner):
    """Reads each piece's boxes from whatever chunks overlap them (DCP's resharding), in place."""

    def __init__(self, pieces: list[_Piece], blob_keys: list[str], path: str):
        super().__init__()
        self.dests: dict[str, list[tuple[tuple[int, ...], tuple[int, ...], torch.Tensor]]] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        for p in pieces:
            self.dests.setdefault(p.key, []).extend(p.chunks())
            assert self.shapes.setdefault(p.key, p.whole_shape) == p.whole_shape, (p.key, p.whole_shape)
        self.blob_keys, self.path, self.blobs = blob_keys, path, {}

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        self.state_dict, self.metadata, self.is_coordinator = state_dict, metadata, is_coordinator

    def create_local_plan(self) -> LoadPlan:
        saved = self.metadata.state_dict_metadata
        requests, wrong = [], []
        for key, chunks in self.dests.items():
            md = saved.get(key)
            if not isinstance(md, TensorStorageMetadata) or tuple(md.size) != self.shapes[key]:
                got = tuple(md.size) if isinstance(md, TensorStorageMetadata) else "none"
                wrong.append(f"{key}: {got} in the checkpoint, {self.shapes[key]} here")
                continue
            requests += create_read_items_for_chunk_list(
                key, md, [ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s)) for o, s, _t in chunks])
        if wrong:
            raise ValueError(f"autopar: the checkpoint in {self.path} does not fit this model: "
                             f"{len(wrong)} tensor(s) differ, e.g. " + "; ".join(wrong[:4]))
        for key in self.blob_keys:
            index = MetadataIndex(key)
            requests.append(ReadItem(type=LoadItemType.BYTE_IO, dest_index=index, dest_offsets=torch.Size((0,)),
                                     storage_index=index, storage_offsets=torch.Size((0,)),
                                     lengths=torch.Size((0,))))
        return LoadPlan(requests)

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        _off, _size, t = self.dests[read_item.dest_index.fqn][read_item.dest_index.index]
        return _narrow(t, read_item.dest_offsets, read_item.lengths)

    def load_bytes(self, read_item: ReadItem, value) -> None:
        self.blobs[read_item.dest_index.fqn] = torch.load(value, weights_only=False)


# -- export -------------------------------------------------------------------------------------


def export(path: str, out: str, *, max_shard_bytes: int = 5 * 2**30) -> list[str]:
    """The model weights of the checkpoint in ``path`` (fp32 masters when mixed precision was
    on; tied parameters once, under their first name) as safetensors that
    ``parallelize(..., weights=out)`` and transformers read: one file when ``out`` ends in
    ``.safetensors``, else an HF-style directory (``model-0000k-of-0000n.safetensors`` shards
    of at most ``max_shard_bytes`` and ``model.safetensors.index.json``; add the model's
    ``config.json`` for ``from_pretrained``). One process, no process group; reads one shard's
    tensors at a time. Returns the files written."""
    from safetensors.torch import save_file

    from autopar.runtime.weights import INDEX

    md = read_metadata(path)
    tensors = {k[len(MODEL):]: v for k, v in md.state_dict_metadata.items()
               if k.startswith(MODEL) and isinstance(v, TensorStorageMetadata)}
    out = os.fspath(out)
    single = out.endswith(".safetensors")
    shards: list[list[str]] = [[]]
    size = 0
    for name, v in tensors.items():
        n = math.prod(v.size) * v.properties.dtype.itemsize
        if not single and shards[-1] and size + n > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    if not single:
        os.makedirs(out, exist_ok=True)
    written, weight_map, total = [], {}, 0
    for i, names in enumerate(shards):
        values = {n: torch.empty(tuple(tensors[n].size), dtype=tensors[n].properties.dtype) for n in names}
        pieces = [_Piece(MODEL + n, tuple(t.shape), 0, max(t.numel(), 1), t.view(-1)) for n, t in values.items()
                  if t.numel()]
        planner = _LoadPlanner(pieces, [], os.fspath(path))
        with _single_process_quiet():
            dcp.load({}, storage_reader=FileSystemReader(os.fspath(path)), planner=planner, no_dist=True)
        file = out if single else os.path.join(out, f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors")
        save_file({n: t.contiguous() for n, t in values.items()}, file, metadata={"format": "pt"})
        written.append(file)
        for n, t in values.items():
            weight_map[n] = os.path.basename(file)
            total += t.numel() * t.element_size()
        del values
    if not single:
        index = os.path.join(out, INDEX)
        with open(index, "w") as fh:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, fh, indent=2)
        written.append(index)
    return written
