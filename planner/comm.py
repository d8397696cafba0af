"""Alpha-beta cost model of point-to-point transfers and collectives (ring algorithms).

Each rank pushes ``link.bandwidth`` bytes/s in one direction and every algorithm step costs
``link.alpha_s``. Sizes are bytes; times are seconds. ``n`` is the number of ranks in the group.
Ring algorithms (NCCL/gloo defaults for large buffers):

* reduce-scatter / all-gather: ``n-1`` steps, each rank sends ``(n-1)/n`` of the full buffer;
* all-reduce = reduce-scatter + all-gather: ``2(n-1)`` steps, ``2(n-1)/n`` of the buffer;
* all-to-all (pairwise exchange): ``n-1`` steps, each rank sends all but its own share.

Pure Python (no torch import) so the planner's search can call it freely.
"""
from __future__ import annotations

import math
import operator

__all__ = ["p2p_time", "all_reduce_time", "reduce_scatter_time", "all_gather_time", "all_to_all_time",
           "group_all_to_all_time", "group_link"]


def _check_bytes(nbytes, what: str) -> float:
    try:
        b = float(nbytes)
    except (TypeError, ValueError):
        raise ValueError(f"autopar: {what}: nbytes must be a number >= 0, got {nbytes!r}") from None
    if not (b >= 0 and math.isfinite(b)):
        raise ValueError(f"autopar: {what}: nbytes must be a finite number >= 0, got {nbytes!r}")
    return b


def _check_n(n, what: str, name: str = "n") -> int:
    try:
        k = operator.index(n)  # ints and integer scalars (numpy), not floats
    except TypeError:
        k = None
    if k is None or isinstance(n, bool) or k < 1:
        raise ValueError(f"autopar: {what}: {name} must be an int >= 1, got {n!r}")
    return k


def p2p_time(nbytes, link) -> float:
    """One message of ``nbytes`` over ``link``: alpha + nbytes / bandwidth."""
    b = _check_bytes(nbytes, "p2p_time")
    return link.alpha_s + b / link.bandwidth


def all_reduce_time(nbytes, n, link) -> float:
    """Ring all-reduce of a ``nbytes`` buffer held by each of ``n`` ranks:
    2(n-1)*alpha + 2(n-1)/n * nbytes / bandwidth; 0 for n == 1."""
    b = _check_bytes(nbytes, "all_reduce_time")
    n = _check_n(n, "all_reduce_time")
    if n == 1:
        return 0.0
    return 2 * (n - 1) * link.alpha_s + 2 * (n - 1) / n * b / link.bandwidth


def reduce_scatter_time(nbytes, n, link) -> float:
    """Ring reduce-scatter of a full (unsharded) ``nbytes`` buffer over ``n`` ranks:
    (n-1)*alpha + (n-1)/n * nbytes / bandwidth; 0 for n == 1."""
    b = _check_bytes(nbytes, "reduce_scatter_time")
    n = _check_n(n, "reduce_scatter_time")
    if n == 1:
        return 0.0
    return (n - 1) * link.alpha_s + (n - 1) / n * b / link.bandwidth


def all_gather_time(nbytes, n, link) -> float:
    """Ring all-gather producing a full ``nbytes`` buffer on each of ``n`` ranks (each holds
    nbytes/n): (n-1)*alpha + (n-1)/n * nbytes / bandwidth; 0 for n == 1."""
    b = _check_bytes(nbytes, "all_gather_time")
    n = _check_n(n, "all_gather_time")
    if n == 1:
        return 0.0
    return (n - 1) * link.alpha_s + (n - 1) / n * b / link.bandwidth


def all_to_all_time(nbytes, n, link) -> float:
    """Pairwise all-to-all where each rank sends ``nbytes`` in total (including the 1/n share it
    keeps): (n-1)*alpha + (n-1)/n * nbytes / bandwidth; 0 for n == 1."""
    b = _check_bytes(nbytes, "all_to_all_time")
    n = _check_n(n, "all_to_all_time")
    if n == 1:
        return 0.0
    return (n - 1) * link.alpha_s + (n - 1) / n * b / link.bandwidth


def group_link(profile, group_size: int, stride: int):
    """The link class of a process group whose members are ``stride`` global ranks apart.

    Ranks are laid out with consecutive ranks on the same node, ``profile.gpus_per_node`` per
    node, and groups are assumed aligned (a group never straddles a node boundary unless it
    spans several nodes): the group is intra-node iff ``stride * group_size <= gpus_per_node``,
    and then uses ``profile.intra``; otherwise ``profile.inter`` (the slowest hop bounds a ring).
    A group of one rank is intra whatever its stride (it never communicates).
    """
    size = _check_n(group_size, "group_link", "group_size")
    stride = _check_n(stride, "group_link", "stride")
    return profile.intra if size == 1 or stride * size <= profile.gpus_per_node else profile.inter


def group_all_to_all_time(profile, nbytes, group_size: int, stride: int) -> float:
    """All-to-all of a group laid out as ``group_link`` assumes, its intra- and inter-node
    parts priced apart: of a rank's ``nbytes``, the shares for the ``g - 1`` other members on its
    node cross ``profile.intra`` and the shares for the ``n - g`` members elsewhere cross
    ``profile.inter``, the two at once (separate links: NVLink and the NICs), so the slower part
    bounds it. ``g`` = members per node. A group within one node is ``all_to_all_time`` over
    ``profile.intra``; with one member per node, over ``profile.inter``."""
    b = _check_bytes(nbytes, "group_all_to_all_time")
    n = _check_n(group_size, "group_all_to_all_time", "group_size")
    stride = _check_n(stride, "group_all_to_all_time", "stride")
    if n == 1:
        return 0.0
    g = max(1, min(n, profile.gpus_per_node // stride)) if stride <= profile.gpus_per_node else 1
    intra, inter = profile.intra, profile.inter
    near = (g - 1) * intra.alpha_s + (g - 1) / n * b / intra.bandwidth if g > 1 else 0.0
    far = (n - g) * inter.alpha_s + (n - g) / n * b / inter.bandwidth if n > g else 0.0
    return max(near, far)

