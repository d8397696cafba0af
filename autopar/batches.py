"""From the batch a process passes to ``step`` / ``evaluate`` to the microbatches it runs.

``batch="global"`` (the default): every process passes the same global batch; dp replica r
takes the r-th contiguous slice along dim 0, cut into ``num_microbatches`` microbatches
(design.md §5). ``batch="local"``: each process passes only its dp replica's slice
(``global / dp`` samples, e.g. from a ``DistributedSampler`` over ``pm.data_parallel_size``
replicas with rank ``pm.data_parallel_rank``); context-parallel ranks pass the whole sequence
(each keeps its shard). A pipeline rank whose stages read neither an input nor the target may
pass ``None`` for it. Every tensor is checked (batch size, per-sample shape, dtype) before any
communication.
"""
from __future__ import annotations

import torch

from autopar.runtime.stage_work import with_strides


def as_inputs(inputs, names: tuple[str, ...] | None = None) -> tuple[tuple, tuple[str, ...] | None]:
    """(the inputs as a tuple, their keyword names or None): a tensor is one positional input,
    a tuple or list positional ones, a dict keyword arguments of ``forward`` (``names``: the
    order the model was captured with; the dict must have exactly those keys)."""
    if isinstance(inputs, torch.Tensor):
        inputs = (inputs,)
    if isinstance(inputs, dict):
        check_packed(inputs)
        keys = names if names is not None else tuple(inputs)
        if set(inputs) != set(keys):
            raise ValueError(f"autopar: the batch has keys {sorted(inputs)}, the model was captured with "
                             f"{sorted(keys)}; pass the same keys every step")
        return tuple(inputs[k] for k in keys), tuple(keys)
    if names is not None:
        raise ValueError(f"autopar: the model was captured with keyword inputs {list(names)}; pass a dict")
    return tuple(inputs), None


def with_shift_labels(inputs: tuple, names, model, loss_fn, cp: int) -> tuple[tuple, tuple[str, ...] | None]:
    """Context parallelism and a causal LM's own loss from ``labels`` (``loss_fn=None``): the
    model shifts the labels of its own shard, so the target of a shard's last token (the next
    shard's first label) would be lost at every shard boundary. Give it ``shift_labels`` too:
    the labels shifted over the whole sequence (-100 at its end), which transformers' causal-LM
    loss (``ForCausalLMLoss``) and this repository's GPT use instead of shifting their shard.
    The inputs unchanged otherwise (cp = 1, a loss_fn, no labels, an encoder-decoder, or
    ``shift_labels`` already given); a ValueError when ``forward`` cannot take it."""
    if cp <= 1 or loss_fn is not None or not names or "labels" not in names or "shift_labels" in names \
            or getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        return inputs, names
    import inspect

    params = inspect.signature(model.forward).parameters.values()
    if not any(p.name == "shift_labels" or p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        raise ValueError(f"autopar: cp={cp} with the model's own loss from labels needs {type(model).__name__}.forward "
                         "to take shift_labels (the labels shifted over the whole sequence: each sequence shard "
                         "would otherwise lose the target of its last token); pass a loss_fn with targets "
                         "aligned to the positions instead, or cp=1")
    labels = inputs[list(names).index("labels")]
    shift = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=-100)
    return tuple(inputs) + (shift,), tuple(names) + ("shift_labels",)


def check_packed(batch: dict) -> None:
    """Refuse packed rows (``position_ids`` restarting inside a row) that also carry an all-ones
    ``attention_mask``: transformers derives the per-document mask from the positions only when
    no mask is given, so with one every document would silently attend to the ones before it."""
    pos, mask = batch.get("position_ids"), batch.get("attention_mask")
    if not (isinstance(pos, torch.Tensor) and isinstance(mask, torch.Tensor)) or pos.dim() != 2 or pos.shape[1] < 2:
        return
    restarts = (pos[:, 1:] - pos[:, :-1] != 1).any(dim=1)
    if mask.shape == pos.shape:
        full = (mask != 0).all(dim=1)
        bad = (restarts & full).nonzero().flatten().tolist()
        if bad:
            raise ValueError(f"autopar: rows {bad[:5]} hold packed documents (position_ids restart inside the row) and "
                             "an all-ones attention_mask: transformers builds the per-document mask from position_ids "
                             "only when attention_mask is None, so every document would attend to the ones before "
                             "it; drop attention_mask from packed batches (autopar.data.pack makes none)")


def data_needed(built) -> set[str]:
    """The captured input/target names this process's stages read."""
    mine = set(built.parallelisms["pp"].my_stages)
    return {name for st in built.stages if st.index in mine for name in st.data}


def replicas_run(built, local: bool):
    """The dp replicas this process runs, as indices into the batch it was given: the one of a
    local batch; its own replica of the global batch; every replica in local mode."""
    if local:
        return [0]
    return [built.mesh.dp_rank] if built.mesh is not None else range(built.plan.dp)


def microbatches(built, inputs: tuple, target, local: bool) -> list[list[dict]]:
    """Per replica this process runs, its microbatches (captured name -> tensor)."""
    plan, m, mb = built.plan, built.num_microbatches, built.microbatch_size
    cap = built.captured
    names = cap.inputs + ([cap.target] if cap.target else [])
    tensors = list(inputs) + ([target] if cap.target else [])
    if len(tensors) != len(names):
        raise ValueError(f"autopar: the model was captured with {len(cap.inputs)} inputs, step got {len(inputs)}")
    shapes = list(built.input_shapes) + ([built.target_shape] if cap.target else [])
    expect = mb * m * (1 if local else plan.dp)
    needed = data_needed(built)
    mode = ("batch='local': this process's dp replica, " if local else "batch='global': the global batch, ")
    for i, (name, t, shape) in enumerate(zip(names, tensors, shapes)):
        what = "the target" if name == cap.target else f"input {i}"
        if t is None:
            if name in needed:
                raise ValueError(f"autopar: {what} is None, but this process's stages read it; pass it (only "
                                 "pipeline ranks that read neither inputs nor the target may pass None)")
            continue
        dtype = cap.node(name).meta["val"].dtype
        if not isinstance(t, torch.Tensor) or t.dim() == 0 or t.shape[0] != expect or tuple(t.shape[1:]) != \
                tuple(shape) or t.dtype != dtype:
            got = f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"autopar: {what} is {got}, but with {mode}{expect} samples of per-sample shape "
                             f"{tuple(shape)} and dtype {dtype} are expected (shapes are static; re-parallelize "
                             "for new shapes)")
    cp = built.parallelisms.get("cp")
    strides = {n: tuple(cap.node(n).meta["val"].stride()) for n in names}

    def shard(name: str, t: torch.Tensor) -> torch.Tensor:
        """This rank's (cp) share, in the layout the programs were traced with."""
        return with_strides(cp.local(t) if cp is not None else t, strides[name])

    out = []
    for replica in replicas_run(built, local):
        mbs = []
        for k in range(m):
            lo = (replica * m + k) * mb
            mbs.append({n: shard(n, t[lo: lo + mb]) for n, t in zip(names, tensors) if t is not None})
        out.append(mbs)
    return out


def label_scales(built, inputs: tuple, names, loss_fn, local: bool, shifted: bool = True,
                 target=None) -> list[list[float]] | None:
    """Design.md §5 loss normalization, for the losses that are a mean over valid labels: a
    model's own loss from ``labels`` in a dict batch (``loss_fn=None``; transformers' causal
    LMs: a mean over the labels that are not -100, each predicted from the position before it),
    and a ``loss_fn`` whose captured loss is a token-mean cross-entropy of the target
    (``built.target_ignore_index``, passes/token_loss.py). Per replica this process runs, per
    microbatch, ``valid labels of the microbatch / valid labels of the whole global batch``, so
    the step's loss and gradient are one mean over every real token of the global batch,
    whatever each microbatch holds (packed rows, padding). ``shifted``: the model predicts each
    label from the position before it (a causal LM: a row's first label is never used); False
    for an encoder-decoder, whose every label counts. None where the rule does not apply
    (another loss, no labels or target, or no valid label at all): the loss is then scaled by
    ``1 / (dp * m * cp)`` as before. Under context parallelism each cp rank's loss is the mean
    over the targets of its sequence shard (``shift_labels``, ``with_shift_labels``; a target
    cut like the inputs): its share is the valid ones of that shard. ``batch="local"``: the
    total is summed over the dp replicas (a collective: every rank calls this)."""
    plan, m, mb = built.plan, built.num_microbatches, built.microbatch_size
    if loss_fn is not None:
        if built.target_ignore_index is None or not isinstance(target, torch.Tensor) or target.dim() < 1:
            return None
        used, ignore = target, built.target_ignore_index
    else:
        if not names or "labels" not in names:
            return None
        names, ignore = list(names), -100
        if plan.cp > 1:
            if "shift_labels" not in names:
                return None
            used = inputs[names.index("shift_labels")]
        else:
            labels = inputs[names.index("labels")]
            if not isinstance(labels, torch.Tensor) or labels.dim() < 2:
                return None
            used = labels[:, 1:] if shifted else labels
    mine = built.parallelisms["cp"].local(used) if plan.cp > 1 else used  # the targets of this rank's positions
    valid = (mine != ignore).reshape(used.shape[0], -1).sum(dim=1).to(torch.float64)
    per_mb = valid.view(-1, mb).sum(dim=1)  # every microbatch of the batch given, in order
    total = (used != ignore).sum().to(torch.float64)
    if local and built.mesh is not None and plan.dp > 1:
        from autopar.collectives import comms

        comms.all_reduce_sum(total, group=built.mesh.replica_group)
    if float(total) == 0:
        return None
    return [[float(per_mb[r * m + k] / total) for k in range(m)] for r in replicas_run(built, local)]


def tokens(inputs: tuple, global_samples: int) -> int:
    """Tokens of a global batch: samples times the sequence length of the first input (1 for
    inputs without one)."""
    first = next((x for x in inputs if isinstance(x, torch.Tensor)), None)
    seq = first.shape[1] if first is not None and first.dim() >= 2 else 1
    return global_samples * seq
