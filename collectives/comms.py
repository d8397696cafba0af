"""Every collective and P2P call autopar makes, in one place.

Pipeline P2P follows NCCL's rules on every backend (schedules/nccl.py): each ordered pair of
pipeline ranks has its own two-rank process group (``runtime/mesh.add_p2p_groups``), so a
rank's sends to a peer and its receives from that peer never queue behind each other, and on
each such channel the messages match **in posting order**: the lowering gives both sides the
same order. Tags are therefore 0 (NCCL ignores them anyway), and gloo matches first-in,
first-out as NCCL does, so every CPU run also proves the order. ``AUTOPAR_P2P_TAGS=1`` tags
each tensor by (sending stage, microbatch, direction, index) instead: a debugging switch for
gloo, which then matches by tag and aborts on a message posted out of order.
``AUTOPAR_P2P_PREFETCH`` says whether receives are posted ahead of their place (``recv_prefetch``).
"""
from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

# NCCL: don't record_stream the tensors of a collective; autopar keeps every tensor a transfer
# touches referenced until its wait (runtime/streams.py). Read when a process group is made.
os.environ.setdefault("TORCH_NCCL_AVOID_RECORD_STREAMS", "1")

_MAX_TENSORS = 256  # tensors crossing one stage boundary (tag space per message)


def p2p_tags_enabled() -> bool:
    """``AUTOPAR_P2P_TAGS=1``: tag P2P tensors (gloo debugging); default 0, NCCL's order matching."""
    return os.environ.get("AUTOPAR_P2P_TAGS", "0") not in ("", "0")


def recv_prefetch(device_type: str) -> bool:
    """Whether receives are posted ahead of their lowered place (runtime/distributed.py): on the
    CPU by default; ``AUTOPAR_P2P_PREFETCH=0`` posts them where the lowered program puts them,
    as on GPUs (``=1`` prefetches there too)."""
    value = os.environ.get("AUTOPAR_P2P_PREFETCH", "")
    return device_type == "cpu" if value == "" else value != "0"


def p2p_tag(send_stage: int, microbatch: int, backward: bool, index: int, num_microbatches: int) -> int:
    """The tag of one tensor of a message when ``p2p_tags_enabled()`` (else every tag is 0)."""
    assert index < _MAX_TENSORS, f"more than {_MAX_TENSORS} tensors cross one stage boundary"
    return ((send_stage * num_microbatches + microbatch) * 2 + int(backward)) * _MAX_TENSORS + index


class PendingRecv:
    """Posted receives for one message; ``wait()`` returns the tensors by name."""

    def __init__(self, works, buffers: dict[str, torch.Tensor], peer: int, what: str):
        self.works, self.buffers, self.peer, self.what = works, buffers, peer, what

    def wait(self, timeout: timedelta) -> dict[str, torch.Tensor]:
        for w in self.works:
            w.wait(timeout)
        return self.buffers


def irecv(buffers: dict[str, torch.Tensor], peer: int, tags: list[int], group=None, what: str = "") -> PendingRecv:
    works = [dist.irecv(t, src=peer, tag=tag, group=group) for t, tag in zip(buffers.values(), tags)]
    return PendingRecv(works, buffers, peer, what)


def isend(tensors: list[torch.Tensor], peer: int, tags: list[int], group=None) -> list:
    """Start sends; the caller keeps the returned (work, tensor) pairs alive until they finish."""
    out = []
    for t, tag in zip(tensors, tags):
        t = t.contiguous()
        out.append((dist.isend(t, dst=peer, tag=tag, group=group), t))
    return out


def all_reduce_sum(tensor: torch.Tensor, group=None, async_op: bool = False):
    return dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=async_op)


# torch 2.13 renamed the flat collectives (*_single); GPU images with torch 2.11 have the old names
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_flat(out: torch.Tensor, shard: torch.Tensor, group=None, async_op: bool = False):
    """``out`` (world * shard.numel()) = every member's shard, concatenated in group rank order."""
    return _all_gather_flat(out, shard, group=group, async_op=async_op)


def reduce_scatter_sum(shard: torch.Tensor, full: torch.Tensor, group=None, async_op: bool = False):
    """``shard`` = this member's slice of the sum over the group of ``full``."""
    return _reduce_scatter_flat(shard, full, op=dist.ReduceOp.SUM, group=group, async_op=async_op)


def all_gather_dim0(tensor: torch.Tensor, group) -> torch.Tensor:
    """Concatenate every group member's tensor along dim 0, in group rank order."""
    n = dist.get_world_size(group)
    out = torch.empty((n * tensor.shape[0], *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
    all_gather_flat(out, tensor, group=group)
    return out


def process_group(group):
    """The ``ProcessGroup`` of a group name (what graph ops carry), or ``group`` itself."""
    return dist.distributed_c10d._resolve_process_group(group) if isinstance(group, str) else group


def is_process_group(group) -> bool:
    return isinstance(group, dist.ProcessGroup)


def group_name(group) -> str:
    """The name graph ops carry of a ``ProcessGroup`` (the world's for None) or a group name."""
    from torch.distributed._functional_collectives import _resolve_group_name

    return _resolve_group_name(dist.group.WORLD if group is None else group)


def rank_in(group) -> int:
    """This process's rank in ``group`` (a name or a ``ProcessGroup``)."""
    return dist.get_rank(process_group(group))


def size_of(group) -> int:
    return dist.get_world_size(process_group(group))


def initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def all_reduce_max(tensor: torch.Tensor, group=None) -> None:
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=process_group(group))


def summed(x: torch.Tensor, group) -> torch.Tensor:
    """A new tensor: the sum over ``group`` of every member's ``x`` (a row linear's partials)."""
    out = x.contiguous().clone()
    all_reduce_sum(out, group=process_group(group))
    return out


def gathered_along(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    """Every member's ``x`` concatenated along ``dim``, in group rank order."""
    return all_gather_dim0(x.movedim(dim, 0).contiguous(), process_group(group)).movedim(0, dim).contiguous()


def scattered_sum_along(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    """This member's block along ``dim`` (block r of the group's size) of the sum over ``group``."""
    pg = process_group(group)
    full = x.movedim(dim, 0).contiguous()
    out = torch.empty((full.shape[0] // dist.get_world_size(pg), *full.shape[1:]), dtype=x.dtype, device=x.device)
    reduce_scatter_sum(out, full, group=pg)
    return out.movedim(0, dim).contiguous()


def all_to_all_autograd(x: torch.Tensor, out_splits, in_splits, group) -> torch.Tensor:
    """The differentiable uneven all-to-all of dim 0 (a functional collective: traceable)."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd

    return all_to_all_single_autograd(x, out_splits, in_splits, group)


def broadcast_object(obj, src: int = 0, group=None):
    """``obj`` of global rank ``src`` on every rank of ``group`` (pickled)."""
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def group_names() -> frozenset[str]:
    """The names of the process groups this process belongs to (what functional collectives in a
    captured graph take as their ``group_name`` argument)."""
    from torch.distributed import distributed_c10d as c10d

    return frozenset(c10d._world.pg_names.values()) if dist.is_initialized() else frozenset()


def all_gather_object(obj, group=None) -> list:
    """Every group member's picklable ``obj``, in group rank order (small build-time exchanges)."""
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def broadcast(tensor: torch.Tensor, src: int, group=None):
    return dist.broadcast(tensor, src=src, group=group)


def share_rng_state(src: int, group) -> None:
    """Every member of ``group`` continues the random number stream of global rank ``src``
    (torch's CPU generator, and the current CUDA device's when CUDA is initialized)."""
    on_gpu = dist.get_backend(group) == "nccl"
    states = [(torch.get_rng_state, torch.set_rng_state)]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states.append((torch.cuda.get_rng_state, torch.cuda.set_rng_state))
    for get, put in states:
        state = get()
        buf = state.cuda() if on_gpu else state
        dist.broadcast(buf, src=src, group=group)
        put(buf.cpu())


def new_group(ranks: list[int], timeout: timedelta | None = None):
    return dist.new_group(ranks=ranks, timeout=timeout)


def default_store():
    """The default process group's store (for failure reports), or None."""
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        return _get_default_store()
    except Exception:  # noqa: BLE001
        return None


def world() -> tuple[int, int]:
    return dist.get_rank(), dist.get_world_size()
