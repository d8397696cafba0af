"""What tensor parallelism shards of each unit at each degree the planner searches
(``TpShare``), from passes/tensor_parallel.py's analysis and the sequence-parallel placement of
the whole capture: the profile (planner/profile.py) attaches them to its unit kinds and the
time and memory models scale a unit's work and activations by them."""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch.fx as fx

from autopar.passes.costs import is_view as _is_view
from autopar.passes.costs import value_bytes

from .programs import is_attention_fwd

TP_DEGREES = (2, 4, 8)  # the tensor-parallel degrees the planner searches (within one node)
TP_WORTH = 0.25         # the least share of parameters tp must shard to be searched (shards_at) ...
TP_EFFICIENCY = 2 / 3   # ... or the least share of each GPU's time it can keep useful


@dataclass(frozen=True)
class TpShare:
    """What tensor parallelism at degree ``tp`` shards of one unit (passes/tensor_parallel.analyze
    on the capture), per captured microbatch: the share of its forward's time in sharded ops
    (``flops``, by a roofline weight per op, ``_op_weight``; their time divides by tp, in F, I and
    W alike), the
    parameter elements and bytes sharded, the share of its forward's value bytes that are sharded
    (saved activations and working sets shrink by it), and the all-reduces one forward runs
    (the row linears' sums; the backward runs as many, in I)."""

    tp: int
    flops: float
    params: int
    param_bytes: int
    activations: float
    reduces: int
    reduce_bytes: float
    attention: bool                 # its attention is sharded by heads (Ulysses' volume per rank / tp)
    sharded: tuple[tuple[str, int], ...] = ()  # (parameter FQN relative to the unit, shard dim)
    # with sequence parallelism (passes/sequence_parallel.py, which the planner always prices
    # with tp): the share of the forward's value bytes token-sharded (1/tp each), the row sums
    # reduce-scattered and the column inputs all-gathered (count, full bytes; the backward runs
    # the reverse collectives, in I, and all-gathers each column input again for its weight
    # gradient: F keeps the rank's block, passes/split_backward._regather_column_inputs), the
    # share of those column inputs (of ``sequence``: whole again from I to W), and the share of
    # the unit's input and output bytes token-sharded (pipeline boundaries)
    sequence: float = 0.0
    scatters: tuple[int, float] = (0, 0.0)
    gathers: tuple[int, float] = (0, 0.0)
    boundary: tuple[float, float] = (0.0, 0.0)
    regathered: float = 0.0


def with_tp_shares(captured, stages, labels, unit_kinds: list) -> list:
    """The unit kinds with what tensor parallelism shards of them at each searched degree
    (``TpShare``, from the pass's analysis of the whole capture: a region is sharded or not as
    the runtime would), read off the last unit of each kind."""
    from autopar.passes.tensor_parallel import analyze

    analyses = {}
    for tp in TP_DEGREES:
        an, _ = analyze(captured, tp)
        sharded = {n.name for n in an.dims} | {n.name for n in an.rows}  # (columns are in dims: their outputs)
        dims = {f: sh.dim for f, sh in an.shards(captured.params, tp, 0).items()}
        # (a vocabulary-parallel embedding sums its output over tp like a row linear)
        analyses[tp] = (sharded, dims, {n.name for n in an.rows} | {n.name for n in an.vocab},
                        _sequence_placement(captured, tp))
    out, done = list(unit_kinds), {}
    # (the last unit of a kind: the first layer reads the replicated embedding output, which
    # sequence parallelism cuts only at the layer's first residual add)
    for k, (st, label, kind) in reversed(list(enumerate(zip(stages, labels, unit_kinds)))):
        if id(kind) not in done:
            shares = tuple(sh for tp in TP_DEGREES if (sh := _tp_share(st, label, tp, *analyses[tp])) is not None)
            # (its remaking variant shards alike: UnitKind.at_tp carries it along)
            done[id(kind)] = replace(kind, tp_shares=shares, remade=replace(kind.remade, tp_shares=shares)
                                     if kind.remade is not None else None)
        out[k] = done[id(kind)]
    return out


# the share of a unit's time in its sharded ops weighs each forward op by a roofline at an
# H100-like balance (compute at 1e15 FLOP/s, memory at 3e12 B/s, the op reading about as many
# bytes as it writes): element-wise ops that stay replicated (norms, residuals) cost time too
_TP_FLOP_RATE, _TP_BANDWIDTH = 1e15, 3e12


def _op_weight(n: fx.Node) -> float:
    return max(n.meta.get("autopar_flops", 0) / _TP_FLOP_RATE, 2 * n.meta.get("autopar_bytes", 0) / _TP_BANDWIDTH)


def _sequence_placement(captured, tp: int) -> tuple[set, set, set]:
    """(the token-sharded values, the column inputs all-gathered, the rows whose sums are
    reduce-scattered) of the capture's nodes under tensor + sequence parallelism at ``tp``: the
    passes' own analyses, on the tensor-parallel rewrite of a copy (no process group needed)."""
    from autopar.passes.sequence_parallel import placement
    from autopar.passes.tensor_parallel import apply_tensor_parallel

    plan = placement(apply_tensor_parallel(captured, tp, 0, "planner").captured.gm.graph, tp)
    names = {n.name for n in captured.gm.graph.nodes}

    def captured_name(n) -> str:  # the sum's operand, or the captured node it was made from (an embedding)
        while n.name not in names:
            n = n.args[0]
        return n.name

    gathered = {c.args[0].name for c in plan.gathered}
    scattered = {captured_name(n.args[0]) for n in plan.seeds}  # (their sums, which readers see, are token-sharded)
    return {n.name for n in plan.dims} | scattered, gathered, scattered


def _tp_share(stage, label, tp: int, sharded: set, dims: dict, rows: set, seq: tuple) -> TpShare | None:
    nodes = [n for n in stage.gm.graph.nodes if n.op == "call_function" and not _is_view(n)]
    total = sum(map(_op_weight, nodes))
    if not total or not any(n.name in sharded or n.name in rows for n in nodes):
        return None
    vbytes = sum(n.meta.get("autopar_bytes", 0) for n in nodes) or 1.0
    vals = {n.name: n.meta.get("val") for n in stage.gm.graph.nodes if n.op == "placeholder"}
    phs = [n.name for n in stage.gm.graph.nodes if n.op == "placeholder"][:len(stage.params)]
    mine = [(fqn, vals[ph]) for ph, fqn in zip(phs, stage.params) if fqn in dims]
    tokens, gathered, scattered = seq
    values = {n.name: n.meta.get("val") for n in stage.gm.graph.nodes}

    def token_share(names) -> float:  # of the bytes of the values ``names``, the token-sharded share
        held = [(n, value_bytes(values.get(n))) for n in names]
        return sum(b for n, b in held if n in tokens) / (sum(b for _n, b in held) or 1)

    return TpShare(tp=tp, flops=sum(_op_weight(n) for n in nodes if n.name in sharded) / total,
                   params=sum(v.numel() for _f, v in mine),
                   param_bytes=sum(v.numel() * v.element_size() for _f, v in mine),
                   activations=sum(n.meta.get("autopar_bytes", 0) for n in nodes if n.name in sharded) / vbytes,
                   reduces=sum(1 for n in nodes if n.name in rows),
                   reduce_bytes=float(sum(n.meta.get("autopar_bytes", 0) for n in nodes if n.name in rows)),
                   attention=any(is_attention_fwd(n) and n.name in sharded for n in nodes),
                   sharded=tuple((fqn[len(label):] if label and fqn.startswith(label + ".") else fqn, dims[fqn])
                                 for fqn, _v in mine),
                   sequence=sum(n.meta.get("autopar_bytes", 0) for n in nodes
                                if n.name in tokens and n.name not in sharded) / vbytes,
                   regathered=sum(n.meta.get("autopar_bytes", 0) for n in nodes
                                  if n.name in gathered and n.name not in sharded) / vbytes,
                   scatters=(sum(1 for n in nodes if n.name in scattered),
                             float(sum(n.meta.get("autopar_bytes", 0) for n in nodes if n.name in scattered))),
                   gathers=(sum(1 for n in stage.gm.graph.nodes if n.name in gathered),
                            float(sum(value_bytes(v) for n, v in values.items() if n in gathered))),
                   boundary=(token_share(stage.inputs), token_share(stage.outputs)))
