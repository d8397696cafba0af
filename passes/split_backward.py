"""Split each stage into F (forward), I (input grad), W (weight grad) and fused B programs.

Per stage we trace ONE joint graph with make_fx:
    outs = stage_forward(params, buffers, constants, data, inputs)
    grads = torch.autograd.grad(differentiable outs, (inputs that need grad, params), tangents)
and partition its nodes by what each output needs:
    F = ancestors of the forward outputs
    I = ancestors of the input gradients, minus F           (recompute: not minus F)
    W = ancestors of the parameter gradients, minus F and I (recompute: minus I only)
    B = I + W
Ops that produce an input grad and weight grads in one call (layer/batch/group norm and
convolution backward) are first cut in two by their ``output_mask`` so that I never computes
a weight gradient and W never computes an input gradient.

Programs exchange values by *key* (passes/keys.py): the runtime keeps one dict per
(stage, microbatch), fills it with what F returns, passes each program the keys it lists, and
drops every key no later program of that microbatch reads.
"""
from __future__ import annotations

import keyword
import logging
import operator
import re

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode
from torch.fx.experimental.proxy_tensor import make_fx

from . import keys, moe_dispatch, tp_ops, tp_rules
from .costs import annotate_costs, graph_flops, is_random, is_view, value_bytes, view_base
from .moe_overlap import spread_dispatch_chains
from .program import Program, StageInfo, StageProgram
from .split_stages import StageGraph

log = logging.getLogger("autopar")
aten = torch.ops.aten

# op -> (index of output_mask argument, number of outputs); output 0 is the input gradient.
_MASKED_BACKWARD = {
    aten.native_layer_norm_backward.default: 7,
    aten.native_batch_norm_backward.default: 9,
    aten.native_group_norm_backward.default: 9,
    aten.convolution_backward.default: 10,
}


def split_backward(stage: StageGraph, input_requires_grad: dict[str, bool], trainable: set[str] | None = None,
                   recompute: bool = False, remake: bool = True) -> StageProgram:
    """Trace the stage's joint graph and partition it into F, I, W and B programs (the one
    form ``remake`` says: ``split_backward_forms``)."""
    return split_backward_forms(stage, input_requires_grad, trainable, recompute, (remake,))[0]


def split_backward_forms(stage: StageGraph, input_requires_grad: dict[str, bool], trainable: set[str] | None = None,
                         recompute: bool = False, forms: tuple[bool, ...] = (True,)) -> list[StageProgram]:
    """Trace the stage's joint graph once and partition it into F, I, W and B programs, once per
    entry of ``forms`` (each a ``remake``), in that order.

    ``input_requires_grad[name]`` says which stage inputs carry a gradient (the previous stage's
    ``diff_outputs``); ``trainable`` is the set of parameter FQNs that get gradients (default all).
    ``recompute``: F keeps only the stage's inputs and I replays the forward. ``remake`` (without
    ``recompute``): the backward makes element-wise values and casts again from what F keeps
    where that keeps fewer bytes (``_recompute_cheap``): less memory, more memory-bound work in
    I and W (fused, nearly free, when the programs are compiled).
    """
    sg = stage.gm
    phs = [n for n in sg.graph.nodes if n.op == "placeholder"]
    n_p, n_b, n_c, n_d = len(stage.params), len(stage.buffers), len(stage.constants), len(stage.data)
    arg_keys = ([keys.param(f) for f in stage.params] + [keys.buffer(f) for f in stage.buffers]
                + [keys.const(c) for c in stage.constants] + [keys.data(d) for d in stage.data]
                + [keys.input(i) for i in stage.inputs])
    assert len(arg_keys) == len(phs)
    trainable = set(stage.params) if trainable is None else trainable
    out_names = _output_names(stage)
    vals = [p.meta["val"] for p in phs]
    fake_mode = detect_fake_mode(vals)
    grad_candidates = _grad_candidates(stage)
    record: dict[str, list] = {}

    def joint_fn(*flat):
        state_and_inputs = flat[: len(phs)]
        tangents = flat[len(phs):]
        outs = sg(*state_and_inputs)
        diff_idx = [i for i in grad_candidates if outs[i].requires_grad]
        in_idx = [j for j in range(n_p + n_b + n_c + n_d, len(phs)) if state_and_inputs[j].requires_grad]
        par_idx = [j for j in range(n_p) if state_and_inputs[j].requires_grad]
        wrt = [state_and_inputs[j] for j in in_idx + par_idx]
        tan = [tangents[grad_candidates.index(i)] for i in diff_idx]
        if diff_idx and wrt:
            grads = torch.autograd.grad([outs[i] for i in diff_idx], wrt, tan, allow_unused=True)
        else:
            grads = [None] * len(wrt)
        g_in = [torch.zeros_like(state_and_inputs[j]) if g is None else g for j, g in zip(in_idx, grads[: len(in_idx)])]
        g_par = list(grads[len(in_idx):])
        record["diff"], record["in"] = diff_idx, in_idx
        record["par"] = [(j, g is not None) for j, g in zip(par_idx, g_par)]
        return (*outs, *g_in, *[g for g in g_par if g is not None])

    with fake_mode:
        args = _trace_args(stage, input_requires_grad, trainable)
        # Gradients arrive contiguous (the runtime makes them so): trace them that way, so the
        # view ops the trace picks are valid at run time. Activations keep their traced strides
        # (StageProgram.input_strides), because the forward graph's views were chosen for them.
        tangents = [torch.empty(_out_val(sg, i).shape, dtype=_out_val(sg, i).dtype, device=_out_val(sg, i).device)
                    for i in grad_candidates]
        joint = make_fx(joint_fn, tracing_mode="real")(*args, *tangents)

    j_phs = [n for n in joint.graph.nodes if n.op == "placeholder"]
    names: dict[fx.Node, str] = {}
    for n, k in zip(j_phs, arg_keys + [keys.grad(out_names[i]) for i in grad_candidates]):
        names[n] = k
    diff_outputs = tuple(out_names[i] for i in record["diff"])
    assert diff_outputs == differentiable_outputs(stage, input_requires_grad, trainable), \
        f"stage {stage.index}: differentiable_outputs disagrees with the joint trace"
    grad_inputs = tuple(stage.inputs[j - (len(phs) - len(stage.inputs))] for j in record["in"])
    grad_params = tuple(stage.params[j] for j, has in record["par"] if has)

    out_node = next(n for n in joint.graph.nodes if n.op == "output")
    flat_out = list(out_node.args[0])
    n_out = len(out_names)
    gin_nodes = flat_out[n_out: n_out + len(grad_inputs)]
    gpar_nodes = flat_out[n_out + len(grad_inputs):]
    assert len(gpar_nodes) == len(grad_params)

    _split_masked_backward(joint, set(_ancestors(gin_nodes)))
    annotate_costs(joint)  # once: the programs below copy each node's meta with it (_partition re-reads the outputs)
    programs = []
    for k, remake in enumerate(forms):
        # every form but the last partitions a copy of the joint graph: partitioning rewrites it
        form, form_names = (joint, names) if k == len(forms) - 1 else _copy_joint(joint, names)
        programs.append(_partition(stage, form, form_names, out_names, grad_inputs, grad_params, diff_outputs,
                                   vals[len(phs) - len(stage.inputs):], recompute, remake))
    return programs


def _copy_joint(joint: fx.GraphModule, names: dict) -> tuple[fx.GraphModule, dict]:
    """A copy of a traced joint graph (new nodes, their meta shallow-copied) and its placeholder keys."""
    graph, val_map = fx.Graph(), {}
    graph.output(graph.graph_copy(joint.graph, val_map))
    return fx.GraphModule(joint, graph), {val_map[n]: k for n, k in names.items()}


def _partition(stage: StageGraph, joint: fx.GraphModule, names: dict, out_names, grad_inputs, grad_params,
               diff_outputs, input_vals, recompute: bool, remake: bool) -> StageProgram:
    """The F, I, W and B programs of one traced joint graph (``split_backward``'s second half;
    ``joint`` is rewritten)."""
    j_phs = [n for n in joint.graph.nodes if n.op == "placeholder"]
    out_node = next(n for n in joint.graph.nodes if n.op == "output")
    flat_out = list(out_node.args[0])
    n_out = len(out_names)
    n_gin = n_out + len(grad_inputs)
    fwd_outs, gin_nodes, gpar_nodes = flat_out[:n_out], flat_out[n_out: n_gin], flat_out[n_gin:]
    if recompute and any(is_random(n) for n in joint.graph.nodes):
        raise ValueError(f"autopar: stage {stage.index} has random ops (dropout?); recomputation would replay "
                         "them with different random numbers. Use recompute=False for this stage.")
    fwd_set = _ancestors(fwd_outs)
    # with recompute, a forward op that communicates or keeps state outside the graph (the MoE dispatch) is
    # never run again: its results are saved like a kept input, and the recomputation stops there
    kept = _never_recomputed(fwd_set) if recompute else set()
    for n in kept:  # ... but its experts keep only their input rows, and I runs them again
        if n.target is moe_dispatch.FORWARD_OPS[1]:
            n.args = tuple(n.args[:5]) + (True,)
    if not recompute:
        _regather_column_inputs(joint, fwd_set)
        if remake:
            _recompute_cheap(joint, fwd_set, {n for n in j_phs if keys.is_state(names[n])})
    # the backward's tensor-parallel collectives are computed in I even where no input gradient
    # needs them (the first stage): W, which fills bubbles, then never communicates
    reduces = [n for n in joint.graph.nodes if (n.target is tp_ops.REDUCE or n.target in
                                                tp_ops.SP_COLLECTIVES) and n not in fwd_set]
    gin_anc = _ancestors(gin_nodes + reduces, stop=kept)
    gpar_anc = _ancestors(gpar_nodes, stop=kept)
    f_nodes = fwd_set | kept  # (a kept op's result only the backward reads is taken in F)
    i_nodes = gin_anc if recompute else gin_anc - fwd_set
    w_nodes = gpar_anc - i_nodes if recompute else gpar_anc - fwd_set - i_nodes
    b_nodes = i_nodes | w_nodes
    # the MoE dispatch chains spread over F and I, so their all-to-alls overlap other work
    # (a stage without input gradients runs the backward chain in W)
    if sum(spread_dispatch_chains(joint.graph, region, phase)
           for region, phase in ((f_nodes, "F"), (i_nodes, "I"), (w_nodes, "I"))):
        joint.graph.lint()
        joint.recompile()

    order = {n: k for k, n in enumerate(joint.graph.nodes)}

    def key_of(n: fx.Node) -> str:
        return names.get(n) or keys.saved(n.name)

    def used_from_outside(region: set, results: list) -> list[fx.Node]:
        need = []
        for n in region:
            for a in n.all_input_nodes:
                if a not in region:
                    need.append(a)
        need += [r for r in results if r not in region]
        return sorted(set(need), key=order.__getitem__)

    # values a region produces that a later region of the same stage reads
    # (with recompute, I and W hold their own copies of forward nodes: those are not saved)
    # (W reads a value from I when I computed it, even if F computed it too)
    from_f = {n for region, outs in ((i_nodes, gin_nodes), (w_nodes, gpar_nodes), (b_nodes, gin_nodes + gpar_nodes))
              for n in used_from_outside(region, outs)
              if n in f_nodes and not (region is w_nodes and n in i_nodes)}
    f_saved = sorted(from_f, key=order.__getitem__)
    i_saved = [n for n in used_from_outside(w_nodes, gpar_nodes) if n in i_nodes]

    fwd_keys = [keys.out(nm) if k < len(stage.outputs) else nm for k, nm in enumerate(out_names)]
    f_prog = _extract(joint, f_nodes, fwd_outs + f_saved, key_of, used_from_outside(f_nodes, fwd_outs),
                      fwd_keys + [key_of(n) for n in f_saved], f"stage{stage.index}_F")
    gin_keys = [keys.gin(nm) for nm in grad_inputs]
    gpar_keys = [keys.gparam(f) for f in grad_params]
    i_prog = _extract(joint, i_nodes, gin_nodes + i_saved, key_of, used_from_outside(i_nodes, gin_nodes),
                      gin_keys + [key_of(n) for n in i_saved], f"stage{stage.index}_I")
    w_prog = _extract(joint, w_nodes, gpar_nodes, key_of, used_from_outside(w_nodes, gpar_nodes),
                      gpar_keys, f"stage{stage.index}_W")
    grads = gin_nodes + gpar_nodes
    b_prog = _extract(joint, b_nodes, grads, key_of, used_from_outside(b_nodes, grads), gin_keys + gpar_keys,
                      f"stage{stage.index}_B")
    if recompute:
        for prog in (i_prog, w_prog, b_prog):
            bad = [k for k in prog.args if keys.is_kind(k, keys.SAVED) and k not in {key_of(n) for n in kept}]
            assert not bad or prog is w_prog, f"recompute stage reads saved forward values {bad}"

    saved_f = sum(value_bytes(n.meta.get("val")) for n in f_saved)
    return StageProgram(
        stage=stage, f=f_prog, i=i_prog, w=w_prog, b=b_prog,
        diff_outputs=diff_outputs, grad_inputs=grad_inputs, grad_params=grad_params,
        input_strides={name: tuple(v.stride()) for name, v in zip(stage.inputs, input_vals)},
        saved_bytes=saved_f, recompute=recompute, joint=joint, remake=remake and not recompute,
    )


def stage_programs(stages: list[StageGraph], trainable: set[str], held=None, recompute=(), remake=None,
                   stop_after: int | None = None, also_remade: bool = False) -> list:
    """Every stage's programs, in stage order: ``split_backward`` for the stages in ``held``
    (default all; a set of indices, or a predicate ``held(stage, input_requires_grad)``), a
    ``StageInfo`` (which outputs carry a gradient: one fake forward) for the others. Stage s's
    inputs carry a gradient where stage s-1's differentiable outputs do.
    ``recompute``: the stage indices whose F keeps only its inputs; ``remake``: those whose
    backward makes element-wise values again (``split_backward``; None: every stage). ``stop_after``: stop once
    that many held stages are split (the rest of the list is left out). ``also_remade``: a held
    stage's entry is (its programs, its programs making element-wise values again), both from
    one trace of its joint graph (``split_backward_forms``)."""
    out: list[StageProgram | StageInfo] = []
    requires: dict[str, bool] = {}
    split = 0
    for st in stages:
        if held is None or (held(st, requires) if callable(held) else st.index in held):
            own = remake is None or st.index in remake
            if also_remade:
                prog, again = split_backward_forms(st, requires, trainable, st.index in recompute, (own, True))
                out.append((prog, again))
            else:
                prog = split_backward(st, requires, trainable, recompute=st.index in recompute, remake=own)
                out.append(prog)
            split += 1
        else:
            prog = StageInfo(st, differentiable_outputs(st, requires, trainable))
            out.append(prog)
        requires = {name: True for name in prog.diff_outputs}
        if stop_after is not None and split >= stop_after:
            break
    return out


def differentiable_outputs(stage: StageGraph, input_requires_grad: dict[str, bool],
                           trainable: set[str] | None = None) -> tuple[str, ...]:
    """The stage outputs that carry a gradient (what `split_backward(...).diff_outputs` will be),
    from one forward replay on fake tensors: cheap enough to run for every stage on every rank
    when a rank traces the joint graphs of its own stages only."""
    vals = [n.meta["val"] for n in stage.gm.graph.nodes if n.op == "placeholder"]
    trainable = set(stage.params) if trainable is None else trainable
    names = _output_names(stage)
    with detect_fake_mode(vals), torch.enable_grad():
        outs = stage.gm(*_trace_args(stage, input_requires_grad, trainable))
    return tuple(names[i] for i in _grad_candidates(stage) if outs[i].requires_grad)


def _output_names(stage: StageGraph) -> list[str]:
    loss = [keys.LOSS] if stage.has_loss else []
    return list(stage.outputs) + [keys.update(f) for f in stage.buffer_updates] + loss


def _grad_candidates(stage: StageGraph) -> list[int]:
    """Output positions that may carry a gradient: float activations a later stage differentiates
    (not ``stage.grad_free``) and the loss, never buffer updates."""
    names = _output_names(stage)
    return [i for i in range(len(names))
            if ((i < len(stage.outputs) and names[i] not in stage.grad_free) or names[i] == keys.LOSS)
            and _is_float(_out_val(stage.gm, i))]


def _trace_args(stage: StageGraph, input_requires_grad: dict[str, bool], trainable: set[str]) -> list:
    """Fake placeholder values (call inside their fake mode): trainable parameters and the inputs
    that carry a gradient require grad."""
    vals = [n.meta["val"] for n in stage.gm.graph.nodes if n.op == "placeholder"]
    first_input = len(vals) - len(stage.inputs)
    args = []
    for j, v in enumerate(vals):
        v = v.detach()
        needs = (j < len(stage.params) and stage.params[j] in trainable) or (
            j >= first_input and input_requires_grad.get(stage.inputs[j - first_input], False))
        if needs and _is_float(v):
            v = v.requires_grad_(True)
        args.append(v)
    return args


def _out_val(gm: fx.GraphModule, i: int):
    out = next(n for n in gm.graph.nodes if n.op == "output")
    return out.args[0][i].meta["val"]


def _is_float(v) -> bool:
    return isinstance(v, torch.Tensor) and (v.is_floating_point() or v.is_complex())


def _never_recomputed(fwd_set: set[fx.Node]) -> set[fx.Node]:
    """Forward nodes a recomputing I/W must read as saved values: the MoE dispatch ops (they
    communicate and keep the routed rows outside the graph) and the results taken from them."""
    ops = {n for n in fwd_set if moe_dispatch.is_dispatch_node(n)}
    return ops | {u for n in ops for u in n.users if u.target is operator.getitem}


def _regather_column_inputs(joint: fx.GraphModule, fwd_set: set[fx.Node]) -> None:
    """Sequence parallelism: the backward reads a column input gathered again, not the forward's.

    A column linear's weight gradient needs its whole input, which the forward all-gathered from
    the token-sharded blocks (``sp_all_gather``). Kept from F to the backward it would cost
    ``[B, S, H]`` per column input; instead F keeps the rank's block (1/tp) and the backward
    all-gathers it again (Megatron-LM does the same), with the views the forward took of it. The
    copy is a collective of the backward, so I runs it (``split_backward``'s I roots) and W, which
    reads its result, never communicates."""
    graph = joint.graph
    gathers = [n for n in graph.nodes if n.target is tp_ops.ALL_GATHER and n in fwd_set]
    if not gathers:
        return
    order = {n: k for k, n in enumerate(graph.nodes)}
    for g in gathers:
        chain, stack = [], [g]  # the all-gather and the forward's views of it
        while stack:
            n = stack.pop()
            chain.append(n)
            stack += [u for u in n.users if u in fwd_set and (is_view(u) or u.target is aten.reshape.default)
                      and u.all_input_nodes == [n]]
        _copy_for_backward(graph, chain, fwd_set, order)
    graph.lint()
    joint.recompile()


def _copy_for_backward(graph: fx.Graph, nodes, fwd_set: set[fx.Node], order: dict) -> None:
    """The backward's readers of forward ``nodes`` read copies of them instead, each copy made
    just before its first reader (copies read copies where they exist; a copy nothing reads is
    dropped). Which region runs a copy follows from what reads it (``split_backward``)."""
    readers = {c: [u for u in c.users if u not in fwd_set and u not in nodes] for c in nodes}
    if not any(readers.values()):
        return
    again: dict[fx.Node, fx.Node] = {}
    out = next(n for n in graph.nodes if n.op == "output")
    with graph.inserting_before(out):
        for c in sorted(nodes, key=order.__getitem__):
            again[c] = graph.node_copy(c, lambda a: again.get(a, a))
    for c, us in readers.items():
        for u in us:
            u.replace_input_with(c, again[c])
    # the last first: a reader is a backward node (after the original and its inputs) or a copy
    # already placed before one
    for c in sorted(nodes, key=order.__getitem__, reverse=True):
        node = again[c]
        if not node.users:
            graph.erase_node(node)
            continue
        pos = {n: k for k, n in enumerate(graph.nodes)}
        min(node.users, key=pos.__getitem__).prepend(node)


# element-wise ops and casts: made again in the backward from what F keeps (memory-bound, no random numbers)
_CASTS = frozenset({aten._to_copy.default})


def _cheap(n: fx.Node, fwd_set: set[fx.Node]) -> bool:
    return (n in fwd_set and (tp_rules.is_elementwise(n) or n.target in _CASTS)
            and n.target.namespace == "aten" and not is_random(n) and isinstance(n.meta.get("val"), torch.Tensor))


def _recompute_cheap(joint: fx.GraphModule, fwd_set: set[fx.Node], state: set[fx.Node]) -> None:
    """Values the backward reads that element-wise ops or casts make from others are made again in
    the backward where that keeps fewer bytes from F to the backward (bitwise the same values).

    Storage by storage (a view keeps its base alive): a kept storage ``b`` made by such an op is
    dropped when its own bytes exceed those of the inputs it needs that nothing keeps yet (state
    is free), greedily, the largest saving first, until none saves. A SwiGLU MLP then keeps its
    gate and up projections, not also ``silu(gate)`` and their product; an fp32 norm keeps its
    bf16 input, not the fp32 copy. The copies are ordinary backward nodes: I or W runs each where
    it is needed, reading what F kept (``split_backward``'s regions)."""
    graph = joint.graph
    order = {n: k for k, n in enumerate(graph.nodes)}

    def base(n: fx.Node) -> fx.Node:
        return view_base(n, items=False)

    def cost(b: fx.Node) -> float:
        return 0.0 if b in state or (b.op != "placeholder" and b not in fwd_set) else value_bytes(b.meta.get("val"))

    kept: dict[fx.Node, int] = {}  # storage -> how many kept values hold it
    for n in list(fwd_set) + [p for p in graph.nodes if p.op == "placeholder"]:
        if any(u not in fwd_set for u in n.users):
            kept[base(n)] = kept.get(base(n), 0) + 1
    dropped: set[fx.Node] = set()
    while True:
        best, gain = None, 0.0
        for b in kept:
            if not _cheap(b, fwd_set):
                continue
            need = {base(a) for a in b.all_input_nodes} - kept.keys()
            g = cost(b) - sum(cost(a) for a in need)
            # (on a tie the later op first: its inputs are more often kept already, so the op
            # that made them can go next, as silu(gate) after silu(gate) * up)
            if g > gain or g == gain and best is not None and order[b] > order[best]:
                best, gain = b, g
        if best is None:
            break
        del kept[best]
        dropped.add(best)
        for a in best.all_input_nodes:
            kept[base(a)] = kept.get(base(a), 0) + 1
    if not dropped:
        return
    # copy each dropped storage and the views of it the backward reads, in graph order
    again_of = set(dropped)
    stack = sorted(dropped, key=order.__getitem__)
    while stack:
        for u in stack.pop().users:
            if u in fwd_set and u not in again_of and is_view(u) and u.target is not operator.getitem \
                    and base(u) in dropped:
                again_of.add(u)
                stack.append(u)
    _copy_for_backward(graph, again_of, fwd_set, order)
    graph.lint()
    joint.recompile()


def _ancestors(nodes, stop=frozenset()) -> set[fx.Node]:
    """call_function ancestors of `nodes` (inclusive), not walking into ``stop``."""
    seen: set[fx.Node] = set()
    stack = [n for n in nodes if isinstance(n, fx.Node)]
    while stack:
        n = stack.pop()
        if n in seen or n.op != "call_function" or n in stop:
            continue
        seen.add(n)
        stack.extend(n.all_input_nodes)
    return seen


def _split_masked_backward(joint: fx.GraphModule, needed_for_inputs: set[fx.Node]) -> None:
    """Cut fused norm/conv backward ops into an input-grad call and a weight-grad call."""
    graph = joint.graph
    for node in list(graph.nodes):
        mask_at = _MASKED_BACKWARD.get(node.target) if node.op == "call_function" else None
        if mask_at is None or node not in needed_for_inputs:
            continue
        getters = {u.args[1]: u for u in node.users if u.target is operator.getitem}
        mask = list(node.args[mask_at])
        weight_side = [i for i in getters if i > 0 and mask[i]]
        if 0 not in getters or not weight_side:
            continue
        with graph.inserting_after(node):
            args_w = list(node.args)
            args_w[mask_at] = [False] + [bool(mask[i]) and i in getters for i in range(1, len(mask))]
            w_node = graph.call_function(node.target, tuple(args_w), dict(node.kwargs))
            w_node.meta = dict(node.meta)
        args_i = list(node.args)
        args_i[mask_at] = [True] + [False] * (len(mask) - 1)
        node.args = tuple(args_i)
        for i in weight_side:
            getters[i].replace_input_with(node, w_node)
    graph.lint()
    joint.recompile()


_IDENT = re.compile(r"[^0-9a-zA-Z_]+")


def _py_name(key: str) -> str:
    name = _IDENT.sub("_", key).strip("_") or "arg"
    if name[0].isdigit() or keyword.iskeyword(name):
        name = "_" + name
    return name


def _extract(joint: fx.GraphModule, region: set, results: list, key_of, inputs: list, result_keys: list,
             name: str) -> Program:
    """A GraphModule computing `results` from `inputs` with the nodes of `region` (joint order)."""
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    arg_keys = []
    for n in inputs:
        ph = g.placeholder(_py_name(key_of(n)))
        ph.meta = dict(n.meta)
        env[n] = ph
        arg_keys.append(key_of(n))
    for n in joint.graph.nodes:
        if n in region:
            env[n] = g.node_copy(n, lambda x: env[x])
    g.output(tuple(env[r] for r in results))
    gm = fx.GraphModule(torch.nn.Module(), g, class_name=name)
    gm.graph.lint()
    return Program(gm=gm, args=tuple(arg_keys), results=tuple(result_keys), flops=graph_flops(gm))
