"""Packed documents: many documents in fixed ``[rows, seq_len]`` rows, none attending to another.

    batch = autopar.data.pack(documents, seq_len=4096)       # documents: 1-D token tensors
    pm = autopar.parallelize(model, batch, loss_fn=None, ...)  # the model's own loss from labels
    pm.step(batch, None)

``pack`` places documents into rows by best-fit decreasing (each document into the row whose
free space it fills best; a document longer than a row is cut into row-long pieces first,
each piece then a document of its own). The batch is what a Hugging Face causal LM takes as
it is:

* ``input_ids`` ``[rows, seq_len]``: the documents, then ``pad_id``;
* ``position_ids``: 0, 1, 2, ... restarting at every document (and at every padding token),
  which is how transformers finds the documents of a packed row when no ``attention_mask`` is
  given (so pass none: an all-ones mask hides the boundaries);
* ``labels``: the tokens, with ``-100`` at each document's first position (transformers
  shifts the labels: that position would be predicted from the previous document's last
  token) and on padding.

``balance(costs, groups)`` orders rows so that consecutive equal slices (dp replicas, then
microbatches: design.md §5) carry about equal cost, ``cost(lengths) = a * tokens + b * sum(l^2)``
(``row_cost``); ``pack(..., groups=g)`` applies it. ``collate(seq_len)`` is a
``torch.utils.data.DataLoader`` ``collate_fn`` (one rank's documents -> its packed batch, with
``batch="local"`` under ``DistributedSampler``). ``packed_batches(stream, seq_len, rows)``
cuts a stream of documents into batches of a fixed row count (static shapes, every step), each
as full as best-fit decreasing packs it.
"""
from __future__ import annotations

import bisect
from typing import Iterable, Iterator, Sequence

import torch

__all__ = ["pack", "balance", "row_cost", "collate", "packed_batches", "packing_stats"]

IGNORE = -100


def _pieces(documents: Sequence[torch.Tensor], seq_len: int) -> list[torch.Tensor]:
    out = []
    for i, d in enumerate(documents):
        if not isinstance(d, torch.Tensor) or d.dim() != 1:
            raise ValueError(f"autopar.data.pack: document {i} must be a 1-D tensor of token ids, got "
                             f"{tuple(d.shape) if isinstance(d, torch.Tensor) else type(d).__name__}")
        out += [p for p in d.split(seq_len) if p.numel()]
    return out


def _best_fit_decreasing(lengths: list[int], seq_len: int) -> list[list[int]]:
    """Piece indices per row: longest first, each into the row with the least free space that
    still holds it (a new row when none does)."""
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # sorted (free space, row index)
    for i in sorted(range(len(lengths)), key=lambda j: (-lengths[j], j)):
        n = lengths[i]
        k = bisect.bisect_left(free, (n, -1))
        if k < len(free):
            space, r = free.pop(k)
        else:
            space, r = seq_len, len(rows)
            rows.append([])
        rows[r].append(i)
        if space - n > 0:
            bisect.insort(free, (space - n, r))
    return rows


def row_cost(lengths: Sequence[int], a: float = 1.0, b: float | None = None, seq_len: int | None = None) -> float:
    """``a * tokens + b * sum(l^2)``: the linear work (projections, MLP) and the attention's
    (quadratic in each document's length). Default ``b = a / seq_len``: a full row of one
    document costs twice its tokens (attention about as costly as the rest at that length)."""
    if b is None:
        b = a / max(seq_len or max(lengths, default=1), 1)
    return a * sum(lengths) + b * sum(n * n for n in lengths)


def balance(costs: Sequence[float], groups: int) -> list[int]:
    """A row order in which ``groups`` consecutive equal slices have about equal total cost:
    longest processing time first, each row to the lightest slice that still has room."""
    n = len(costs)
    if groups < 1 or n % groups:
        raise ValueError(f"autopar.data.balance: {n} rows cannot be cut into {groups} equal slices; pack with "
                         f"rows= a multiple of {groups}")
    size = n // groups
    load = [0.0] * groups
    members: list[list[int]] = [[] for _ in range(groups)]
    for i in sorted(range(n), key=lambda j: (-costs[j], j)):
        g = min((g for g in range(groups) if len(members[g]) < size), key=lambda g: (load[g], g))
        members[g].append(i)
        load[g] += costs[i]
    return [i for m in members for i in m]


def pack(documents: Sequence[torch.Tensor], seq_len: int, *, pad_id: int = 0, rows: int | None = None,
         groups: int = 1, a: float = 1.0, b: float | None = None) -> dict[str, torch.Tensor]:
    """Documents (1-D token tensors) -> ``{"input_ids", "position_ids", "labels"}``, each
    ``[rows, seq_len]`` (module docstring). ``rows``: exactly that many rows (padding rows
    added; a ValueError when the documents need more); else as many as best-fit needs, rounded
    up to a multiple of ``groups``. ``groups`` > 1: rows ordered by ``balance`` into that many
    equal slices of about equal ``row_cost`` (e.g. dp * microbatches)."""
    if seq_len < 1:
        raise ValueError(f"autopar.data.pack: seq_len must be positive, got {seq_len}")
    pieces = _pieces(documents, seq_len)
    lengths = [int(p.numel()) for p in pieces]
    placed = _best_fit_decreasing(lengths, seq_len)
    need = len(placed)
    total = rows if rows is not None else -(-max(need, 1) // groups) * groups
    if total < need:
        raise ValueError(f"autopar.data.pack: the documents need {need} rows of {seq_len} tokens, "
                         f"more than rows={rows}")
    placed += [[] for _ in range(total - need)]
    if groups > 1:
        costs = [row_cost([lengths[i] for i in r], a, b, seq_len) for r in placed]
        placed = [placed[i] for i in balance(costs, groups)]
    dtype = pieces[0].dtype if pieces else torch.long
    ids = torch.full((total, seq_len), pad_id, dtype=dtype)
    pos = torch.zeros((total, seq_len), dtype=torch.long)
    labels = torch.full((total, seq_len), IGNORE, dtype=torch.long)
    for r, members in enumerate(placed):
        at = 0
        for i in members:
            n = lengths[i]
            ids[r, at:at + n] = pieces[i]
            pos[r, at:at + n] = torch.arange(n)
            labels[r, at + 1:at + n] = pieces[i][1:].long()
            at += n
    return {"input_ids": ids, "position_ids": pos, "labels": labels}


def packed_batches(documents: Iterable[torch.Tensor], seq_len: int, rows: int, **kwargs) -> Iterator[dict]:
    """Batches of exactly ``rows`` rows from a stream of documents: each takes documents in
    stream order while best-fit decreasing still packs them into ``rows`` rows; the first that
    does not fit starts the next batch. Nothing is dropped or reordered across batches: a
    document longer than a row is cut into row-long pieces first (each then a document of its
    own, as ``pack`` cuts it), and the pieces of a long one may continue in the next batch.
    ``kwargs``: ``pack``'s (``groups`` = dp x microbatches to balance the rows, ``pad_id``,
    ``a``, ``b``). The last batch may be partly padding."""
    if rows < 1:
        raise ValueError(f"autopar.data.packed_batches: rows must be positive, got {rows}")
    held: list[torch.Tensor] = []
    lengths: list[int] = []
    for piece in (p for d in documents for p in _pieces([d], seq_len)):
        n = int(piece.numel())
        if held and len(_best_fit_decreasing(lengths + [n], seq_len)) > rows:
            yield pack(held, seq_len, rows=rows, **kwargs)
            held, lengths = [], []
        held.append(piece)
        lengths.append(n)
    if held:
        yield pack(held, seq_len, rows=rows, **kwargs)


def packing_stats(lengths: Sequence[int], seq_len: int) -> dict:
    """What packing documents of these lengths into rows of ``seq_len`` gives (``pack``'s
    placement, no tokens needed): ``documents``, ``tokens``, ``rows``, ``fill`` (real tokens over
    the rows' slots) and ``attention_share``: the query-key pairs within documents over those of
    full rows (sum of l^2 over rows x seq_len^2; what a kernel that skips other documents' blocks
    computes, where a dense mask computes every pair)."""
    bad = [n for n in lengths if int(n) != n or n < 1]
    if bad or seq_len < 1:
        raise ValueError(f"autopar.data.packing_stats: lengths must be positive integers and seq_len >= 1, got "
                         f"{bad[:3] or seq_len}")
    pieces = [min(seq_len, int(n) - k) for n in lengths for k in range(0, int(n), seq_len)]
    rows = len(_best_fit_decreasing(pieces, seq_len)) if pieces else 0
    tokens = sum(pieces)
    return {"documents": len(lengths), "tokens": tokens, "rows": rows,
            "fill": tokens / (rows * seq_len) if rows else 0.0,
            "attention_share": sum(n * n for n in pieces) / (rows * seq_len ** 2) if rows else 0.0}


def collate(seq_len: int, **kwargs):
    """A DataLoader ``collate_fn``: a list of documents -> ``pack(documents, seq_len, **kwargs)``."""
    def fn(documents):
        return pack(list(documents), seq_len, **kwargs)

    return fn
