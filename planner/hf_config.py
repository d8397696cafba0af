"""Plan a Hugging Face model from its ``config.json`` alone: ``autopar plan --hf-config PATH``.

What every user of a public model has on disk is its configuration, not Python code. This
builds the causal LM that ``transformers`` builds from it, on the meta device (no memory, no
weights, no download), at a reduced depth, and tells the planner how many real layers each
built layer stands for:

* the decoder layers are the model's ``nn.ModuleList`` of ``num_hidden_layers`` modules;
* each layer has a *kind*: its class, its parameters' names and shapes (a dense MLP and an MoE
  block differ; so do layers with other projections) and its ``layer_types`` entry where the
  config has one (sliding-window and full attention differ in cost, not in parameters);
* the model is built again with the shortest prefix of layers that holds every kind (every
  per-layer list of the config cut to that length), and each built layer stands for its kind's
  real layers, shared as evenly as the built layers of that kind allow. The built prefix must
  give the same kinds as the full model's first layers; otherwise it is planned at full depth.

A multimodal configuration (a ``text_config`` inside: Llama 4, Gemma 3, Mistral 3, ...) is
planned as its language model, the causal LM of its text configuration; the other towers are
left out, and the report says so.

MoE blocks are priced as the dropless dispatch expert parallelism runs (``dispatch_form`` in
the profile); their experts' parameters are recognized by ``.experts.`` in their names (a
shared expert's ``shared_experts.`` is not). The loss is next-token cross entropy on fp32 logits.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPERT_PREFIXES = (".experts.",)
_EXPERT_COUNT_ATTRS = ("num_local_experts", "n_routed_experts", "num_experts")


@dataclass
class HFPlanModel:
    name: str
    model: nn.Module
    inputs: tuple
    target: torch.Tensor
    loss_fn: object
    layer_repeats: dict
    num_layers: int
    n_heads: int
    n_experts: int


def load_config(path: str):
    """A ``transformers`` config from a ``config.json`` file or a directory holding one."""
    try:
        import transformers
    except ImportError as e:  # the planner itself does not need transformers
        raise ValueError("--hf-config needs transformers: pip install 'autopar[hf]'") from e
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise ValueError(f"--hf-config {path}: no such file (give a config.json or the directory that holds it)")
    with open(file) as f:
        data = json.load(f)
    kind = data.pop("model_type", None)
    if kind is None:
        raise ValueError(f"--hf-config {file}: no \"model_type\" in it, so transformers cannot tell which model it is")
    try:
        return transformers.AutoConfig.for_model(kind, **data)
    except Exception as e:  # noqa: BLE001 - transformers' validation of the user's numbers: one line, with why
        raise ValueError(f"--hf-config {file}: transformers {transformers.__version__} cannot make a config of "
                         f"model_type {kind!r} from it ({_why(e)})") from e


def _why(e: Exception) -> str:
    """transformers' reason on one line: the innermost exception's last non-empty line."""
    while e.__cause__ is not None:
        e = e.__cause__
    lines = [x.strip() for x in str(e).splitlines() if x.strip()]
    return (lines[-1] if lines else type(e).__name__)[:200]


def _build(cfg, dtype):
    import transformers

    with torch.device("meta"):
        try:
            model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype)
        except Exception as e:  # noqa: BLE001 - transformers' own code on the user's config: one line, with why
            raise ValueError(f"--hf-config: transformers cannot build a causal LM from this {type(cfg).__name__}: "
                             f"{type(e).__name__}: {_why(e)} (--hf-config plans "
                             "causal language models)") from e
    return model


def _layers(model: nn.Module, n: int) -> tuple[str, nn.ModuleList]:
    """The model's decoder layers: its (first) ModuleList of ``n`` modules."""
    for path, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and len(mod) == n:
            return path, mod
    raise ValueError(f"--hf-config: {type(model).__name__} has no list of num_hidden_layers={n} layers")


def _kind(cfg, i: int, layer: nn.Module) -> tuple:
    types = getattr(cfg, "layer_types", None)
    params = tuple((name, tuple(p.shape)) for name, p in layer.named_parameters())
    mods = tuple(type(m).__name__ for m in layer.modules())
    return (types[i] if isinstance(types, (list, tuple)) and i < len(types) else None, mods, params)


def _cut(cfg, full: int, depth: int):
    """A copy of ``cfg`` with ``depth`` layers: every per-layer list cut to that length."""
    import copy

    out = copy.deepcopy(cfg)
    for key, value in vars(cfg).items():
        if isinstance(value, (list, tuple)) and len(value) == full and key != "architectures":
            setattr(out, key, type(value)(value[:depth]))
    out.num_hidden_layers = depth
    return out


def _spread(total: int, parts: int) -> list[int]:
    base, extra = divmod(total, parts)
    return [base + (1 if j < extra else 0) for j in range(parts)]


def hf_lm_loss(out, target):
    """Next-token cross entropy on the logits, in fp32."""
    logits = out.logits if hasattr(out, "logits") else out[0]
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), target.reshape(-1))


def build_from_config(path: str, seq_len: int, microbatch_size: int = 1, dtype=torch.bfloat16,
                      full_depth: bool = False, say=lambda msg: None) -> HFPlanModel:
    """The model of ``path`` (a config.json or its directory) on the meta device, reduced in
    depth (module docstring), with one ``[microbatch_size, seq_len]`` token microbatch."""
    cfg = load_config(path)
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    if text is not cfg:  # a multimodal model (Llama 4, Gemma 3, Mistral 3 ...): its language model
        say(f"{type(cfg).__name__}: planning its language model ({type(text).__name__}); the other towers "
            "(vision, audio) are not planned")
        cfg = text
    cfg.use_cache = False  # what training sets
    n = int(getattr(cfg, "num_hidden_layers", 0) or 0)
    if n < 1:
        raise ValueError(f"--hf-config {path}: no num_hidden_layers in the config")
    full = _build(cfg, dtype)
    where, layers = _layers(full, n)
    kinds = [_kind(cfg, i, layer) for i, layer in enumerate(layers)]
    depth = n
    if not full_depth:
        seen: set = set()
        want = set(kinds)
        for i, k in enumerate(kinds):
            seen.add(k)
            if seen == want:
                depth = i + 1
                break
    model, repeats = full, {}
    if depth < n:
        small_cfg = _cut(cfg, n, depth)
        small = _build(small_cfg, dtype)
        s_where, s_layers = _layers(small, depth)
        if s_where == where and [_kind(small_cfg, i, lay) for i, lay in enumerate(s_layers)] == kinds[:depth]:
            model = small
            for k in set(kinds):
                mine = [i for i in range(depth) if kinds[i] == k]
                for i, count in zip(mine, _spread(kinds.count(k), len(mine))):
                    repeats[f"{where}.{i}"] = count
        else:
            say(f"the first {depth} layers built alone differ from the full model's: planning all {n} layers")
            depth = n
    del full
    say(f"{type(model).__name__}: {n} layers of {len(set(kinds))} kind(s), built with {depth} on the meta device")
    with torch.device("meta"):
        tokens = torch.empty(microbatch_size, seq_len, dtype=torch.long)
        target = torch.empty(microbatch_size, seq_len, dtype=torch.long)
    n_experts = next((int(v) for a in _EXPERT_COUNT_ATTRS if isinstance(v := getattr(cfg, a, None), int) and v > 1), 0)
    name = f"{type(model).__name__} ({os.path.basename(os.path.normpath(path))})"
    return HFPlanModel(name=name, model=model, inputs=(tokens,), target=target, loss_fn=hf_lm_loss,
                       layer_repeats=repeats, num_layers=n, n_heads=int(getattr(cfg, "num_attention_heads", 0) or 0),
                       n_experts=n_experts)
