"""Cut the captured forward graph into S pipeline stages, balanced by estimated cost.

The graph's compute nodes are kept in their (topological) order and cut at S-1 positions.
A cut is only allowed where every value crossing it is a tensor. Among allowed cuts we prefer
block boundaries (where the outermost indexed module, e.g. ``blocks.3``, changes) when they
balance almost as well as arbitrary positions. Two phases:
  1. the smallest bottleneck B* (the most expensive stage), by bisection with a greedy check;
  2. among cuttings whose every stage costs at most (1 + tolerance) * B*, the one where the
     fewest bytes cross the cuts (dynamic program with a sliding-window minimum).

Every value a later stage needs crosses every cut in between: stage k receives exactly what
stage k-1 sends, so a skip connection from stage 0 into stage 3 is forwarded by stages 1 and 2
(an identity output). Parameters, buffers, constants and the data (model inputs, target) are
not activations: each stage takes the ones it uses directly, so a tied parameter used by two
stages appears in both and gets one gradient from each, summed by the runtime.
"""
from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass

import torch
import torch.fx as fx

from .captured import CapturedGraph
from .costs import node_time
from .grad_mode import gradient_paths

# IN_FLIGHT_OPS: a MoE dispatch chain's handle before its last op stays in its stage
from .moe_dispatch import IN_FLIGHT_OPS

log = logging.getLogger("autopar")

BALANCE_TOLERANCE = 0.10  # a cutting may be this much less balanced than the best to cross fewer bytes
BLOCK_PREFERENCE = 0.25   # block-boundary cuts are used if their bottleneck is within 25% of the best


@dataclass
class StageGraph:
    """One stage's forward graph and how its placeholders/outputs map to model state.

    gm placeholders, in order: params, buffers, constants, data, inputs.
    gm outputs, in order: outputs (activations for the next stage), buffer updates, [loss].
    """

    index: int
    gm: fx.GraphModule
    params: tuple[str, ...]        # canonical parameter FQNs
    buffers: tuple[str, ...]       # buffer FQNs
    constants: tuple[str, ...]     # captured constant placeholder names
    data: tuple[str, ...]          # captured placeholder names of model inputs / target used here
    inputs: tuple[str, ...]        # activation names received from stage index-1
    outputs: tuple[str, ...]       # activation names sent to stage index+1
    buffer_updates: tuple[str, ...]  # buffer FQN of each buffer-update output
    has_loss: bool
    cost: float                    # balancing estimate (seconds on the balance roofline)
    flops: int
    # outputs no later stage differentiates: no gradient comes back for them (a value read only
    # through the detach of a no-grad region, passes/grad_mode.py), whatever requires grad here
    grad_free: tuple[str, ...] = ()

    @property
    def bytes_in(self) -> int:
        return sum(_val_bytes(n) for n in self.gm.graph.nodes
                   if n.op == "placeholder" and n.name in self.inputs)

    @property
    def bytes_out(self) -> int:
        out = next(n for n in self.gm.graph.nodes if n.op == "output")
        return sum(_val_bytes(v) for v in out.args[0][: len(self.outputs)])


def _val_bytes(node: fx.Node) -> int:
    return node.meta.get("autopar_bytes", 0)


def split_stages(captured: CapturedGraph, num_stages: int, cuts: list[int] | None = None) -> list[StageGraph]:
    """Split ``captured`` into ``num_stages`` stage graphs.

    ``cuts`` (optional) fixes the S-1 cut positions (indices into the list of compute nodes),
    e.g. from a plan's stage boundaries; otherwise they are chosen here.
    """
    graph = captured.gm.graph
    order = [n for n in graph.nodes if n.op in ("call_function", "get_attr")]
    if num_stages < 1:
        raise ValueError(f"autopar: num_stages must be >= 1, got {num_stages}")
    if cuts is None:
        cuts = choose_cuts(captured, num_stages)
    else:
        cuts = list(cuts)
        in_range = not cuts or (0 < cuts[0] and cuts[-1] < len(order))
        if len(cuts) != num_stages - 1 or sorted(set(cuts)) != cuts or not in_range:
            raise ValueError(f"autopar: stage cuts {cuts} must be {num_stages - 1} increasing positions in "
                             f"1..{len(order) - 1}")
        allowed = crossing_profile(order)[1]
        bad = [c for c in cuts if not allowed[c]]
        if bad:
            raise ValueError(f"autopar: cannot cut before compute node(s) at {bad}: a non-tensor value would cross")
    bounds = [0] + cuts + [len(order)]
    pos = {n: i for i, n in enumerate(order)}
    graded = gradient_paths(graph, captured.node(captured.loss))
    stages = []
    for k in range(num_stages):
        stages.append(_build_stage(captured, order, pos, k, bounds[k], bounds[k + 1], num_stages, graded))
    return stages


# ---------------------------------------------------------------------------------------------
# choosing cuts


def _last_use(order: list[fx.Node], pos: dict) -> dict[fx.Node, int]:
    last = {}
    for n in order:
        uses = [pos[u] for u in n.users if u in pos]
        last[n] = max(uses) if uses else -1
    return last


def _unwaited_collective(node: fx.Node) -> bool:
    """The output of a functional collective before its ``wait_tensor`` (CP/EP all-to-alls), or
    the handle of a MoE dispatch chain before its last op (passes/moe_dispatch.py: rows in
    flight, state in this process): it must not cross a stage cut (the receiving rank would get
    a value still in flight)."""
    target = getattr(node, "target", None)
    if target in IN_FLIGHT_OPS:
        return True
    ns = getattr(target, "namespace", None)
    return ns == "_c10d_functional" and "wait_tensor" not in str(target)


def crossing_profile(order: list[fx.Node]) -> tuple[list[int], list[bool]]:
    """For every cut position c (between order[c-1] and order[c]): bytes crossing, and whether
    the cut is allowed (only finished tensors cross). Index 0 and len(order) are the graph's ends."""
    pos = {n: i for i, n in enumerate(order)}
    last = _last_use(order, pos)
    n = len(order)
    diff = [0] * (n + 2)
    bad = [0] * (n + 2)
    for node in order:
        d, lu = pos[node], last[node]
        if lu <= d:
            continue
        # the value is live across cuts d+1 .. lu
        diff[d + 1] += _val_bytes(node)
        diff[lu + 1] -= _val_bytes(node)
        if not isinstance(node.meta.get("val"), torch.Tensor) or _unwaited_collective(node):
            bad[d + 1] += 1
            bad[lu + 1] -= 1
    crossing, allowed = [], []
    acc = accb = 0
    for c in range(n + 1):
        acc += diff[c]
        accb += bad[c]
        crossing.append(acc)
        allowed.append(accb == 0)
    return crossing, allowed


def block_key(node: fx.Node):
    """Outermost module path that is an element of a container (``blocks.3``), or None."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ...  # unknown: inherit the previous node's key
    for path, _type in stack.values():
        parts = path.split(".")
        for i, part in enumerate(parts):
            if part.isdigit():
                return ".".join(parts[: i + 1])
    return None


def choose_cuts(captured: CapturedGraph, num_stages: int) -> list[int]:
    order = [n for n in captured.gm.graph.nodes if n.op in ("call_function", "get_attr")]
    n = len(order)
    if num_stages == 1:
        return []
    crossing, allowed = crossing_profile(order)
    prefix = [0.0]
    for node in order:
        prefix.append(prefix[-1] + node_time(node))
    all_cands = [c for c in range(1, n) if allowed[c]]
    if len(all_cands) < num_stages - 1:
        raise ValueError(f"autopar: the graph has only {len(all_cands) + 1} places it can be split into stages, "
                         f"fewer than the {num_stages} stages asked for; use pp*stages_per_rank <= "
                         f"{len(all_cands) + 1}")
    keys, prev = [], None
    for node in order:
        k = block_key(node)
        prev = prev if k is ... else k
        keys.append(prev)
    block_cands = [c for c in all_cands if keys[c] != keys[c - 1]]
    b_all = _min_bottleneck(prefix, all_cands, num_stages)
    cands = all_cands
    if len(block_cands) >= num_stages - 1:
        b_blk = _min_bottleneck(prefix, block_cands, num_stages)
        if b_blk <= (1 + BLOCK_PREFERENCE) * b_all:
            cands = block_cands
    bottleneck = _min_bottleneck(prefix, cands, num_stages)
    cuts = _min_crossing_cuts(prefix, crossing, cands, num_stages, bottleneck * (1 + BALANCE_TOLERANCE) + 1e-18)
    log.debug("split_stages: %d nodes, %d candidate cuts, bottleneck %.3g, cuts %s", n, len(cands), bottleneck, cuts)
    return cuts


def _greedy_stages(prefix, cands, limit) -> int | None:
    """Fewest stages with every stage cost <= limit using cuts from cands; None if impossible."""
    end = len(prefix) - 1
    start, count, i = 0, 1, 0
    points = cands + [end]
    while prefix[end] - prefix[start] > limit:
        best = None
        while i < len(points) and prefix[points[i]] - prefix[start] <= limit:
            best = points[i]
            i += 1
        if best is None or best == start:
            return None
        start, count = best, count + 1
    return count


def _min_bottleneck(prefix, cands, num_stages) -> float:
    total = prefix[-1]
    lo, hi = total / num_stages, total
    if _feasible(prefix, cands, num_stages, lo):
        return lo
    for _ in range(60):
        mid = (lo + hi) / 2
        if _feasible(prefix, cands, num_stages, mid):
            hi = mid
        else:
            lo = mid
        if hi - lo <= 1e-9 * max(total, 1e-30):
            break
    return hi


def _feasible(prefix, cands, num_stages, limit) -> bool:
    count = _greedy_stages(prefix, cands, limit)
    # fewer stages than asked is fine: more cuts only make stages cheaper (cands are plentiful)
    return count is not None and count <= num_stages


def _min_crossing_cuts(prefix, crossing, cands, num_stages, limit) -> list[int]:
    """Exactly num_stages-1 cuts from cands, every stage cost <= limit, minimal total crossing bytes."""
    inf = float("inf")
    end = len(prefix) - 1
    pts = [0] + cands  # index 0 is the graph start
    m = len(pts)
    # dp[j] = best total bytes with the latest cut at pts[j]; parent pointers per layer
    dp = [0.0] + [inf] * (m - 1)
    parents = []
    for _layer in range(num_stages - 1):
        new, par = [inf] * m, [-1] * m
        window: deque[int] = deque()  # indices i < j with prefix[pts[j]] - prefix[pts[i]] <= limit, dp increasing
        lo = 0
        for j in range(1, m):
            # admit i = j-1
            i = j - 1
            if dp[i] < inf:
                while window and dp[window[-1]] >= dp[i]:
                    window.pop()
                window.append(i)
            while lo < j and prefix[pts[j]] - prefix[pts[lo]] > limit:
                lo += 1
            while window and window[0] < lo:
                window.popleft()
            if window:
                new[j] = dp[window[0]] + crossing[pts[j]]
                par[j] = window[0]
        dp = new
        parents.append(par)
    best_j, best = -1, inf
    for j in range(1, m):
        if dp[j] < inf and prefix[end] - prefix[pts[j]] <= limit and dp[j] < best:
            best, best_j = dp[j], j
    assert best_j >= 0, "bottleneck search and crossing DP disagree"
    cuts = []
    j = best_j
    for par in reversed(parents):
        cuts.append(pts[j])
        j = par[j]
    return sorted(cuts)


# ---------------------------------------------------------------------------------------------
# building stage graphs


def _build_stage(captured: CapturedGraph, order, pos, k, a, b, num_stages, graded: set[fx.Node]) -> StageGraph:
    nodes = order[a:b]
    inside = set(nodes)
    live_in = [n for n in order[:a] if any(pos.get(u, -1) >= a for u in n.users if u in pos)]
    last = k == num_stages - 1
    live_out = [] if last else [n for n in order[:b] if any(pos.get(u, -1) >= b for u in n.users if u in pos)]
    out_node = next(n for n in captured.gm.graph.nodes if n.op == "output")
    finals = list(out_node.args[0])

    used_ph = []
    for n in nodes:
        for arg in n.all_input_nodes:
            if arg.op == "placeholder" and arg not in used_ph:
                used_ph.append(arg)
    for v in finals:  # a buffer update or loss that *is* a placeholder (degenerate, but keep it right)
        if v.op == "placeholder" and v not in used_ph and k == num_stages - 1:
            used_ph.append(v)
    params = [p for p in used_ph if p.name in captured.params]
    buffers = [p for p in used_ph if p.name in captured.buffers]
    consts = [p for p in used_ph if p.name in captured.constants]
    data_names = captured.inputs + ([captured.target] if captured.target else [])
    data = sorted([p for p in used_ph if p.name in data_names], key=lambda p: data_names.index(p.name))

    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for p in params + buffers + consts + data + live_in:
        ph = g.placeholder(p.name)
        ph.meta = dict(p.meta)
        env[p] = ph
    for n in nodes:
        env[n] = g.node_copy(n, lambda x: env[x])
    outs = [env[v] for v in live_out]
    updates = []
    for v in finals:
        if v.name in captured.buffer_updates and v in env and (v in inside or (v.op == "placeholder" and last)):
            outs.append(env[v])
            updates.append(captured.buffer_updates[v.name])
    has_loss = False
    loss_node = captured.node(captured.loss)
    if loss_node in inside or (k == num_stages - 1 and loss_node in env):
        outs.append(env[loss_node])
        has_loss = True
    g.output(tuple(outs))
    g.eliminate_dead_code()
    gm = fx.GraphModule(torch.nn.Module(), g)
    gm.graph.lint()
    assert has_loss == (k == num_stages - 1), f"loss landed in stage {k} of {num_stages}"
    return StageGraph(
        index=k, gm=gm,
        params=tuple(captured.params[p.name] for p in params),
        buffers=tuple(captured.buffers[p.name] for p in buffers),
        constants=tuple(p.name for p in consts),
        data=tuple(p.name for p in data),
        inputs=tuple(n.name for n in live_in),
        outputs=tuple(n.name for n in live_out),
        buffer_updates=tuple(updates),
        has_loss=has_loss,
        cost=sum(node_time(n) for n in nodes),
        flops=sum(n.meta.get("autopar_flops", 0) for n in nodes),
        grad_free=tuple(n.name for n in live_out if n not in graded),
    )


__all__ = ["StageGraph", "split_stages", "choose_cuts", "crossing_profile", "block_key"]
