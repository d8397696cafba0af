"""Reading model weights from a checkpoint, tensor by tensor, so each rank reads only what it holds.

``open_weights(weights)`` accepts

* a ``.safetensors`` file (memory-mapped: reading a tensor, or rows of one, reads its bytes);
* a Hugging Face-style directory: ``model.safetensors.index.json`` (``weight_map``: tensor name
  -> shard file) with its shards, or a single ``model.safetensors`` in it;
* a ``torch.save``d state dict (``.pt``/``.pth``/``.bin``; loaded with ``mmap=True``, so only the
  tensors read are paged in);
* an in-memory state dict.

Names are the model's FQNs. ``check_against(reader, expected, aliases)`` compares the
checkpoint's names, shapes and dtypes with the model's (before anything is read or any
collective runs) and raises one ``ValueError`` naming the first few problems: missing keys (a
tied parameter may be stored under any one of its names), unexpected keys, shapes, and dtypes.
A dtype is accepted when it converts to the model's without loss (the same dtype, or a float
widened: a bf16 checkpoint into an fp32 model); anything else (narrowing a float, int <->
float, another int width) is an error.
"""
from __future__ import annotations

import json
import os
from typing import Mapping

import torch

_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                       "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                       "U8": torch.uint8, "BOOL": torch.bool}
INDEX = "model.safetensors.index.json"


class CheckpointReader:
    """Names, shapes and dtypes of a checkpoint's tensors, and reads of single tensors or blocks
    of them (``rows``: a slice of dim 0, or a tuple of slices); ``bytes_read`` counts the bytes of
    every tensor (or block) read so far."""

    def __init__(self, meta: dict[str, tuple[tuple[int, ...], torch.dtype]], describe: str):
        self.meta = meta
        self.describe = describe
        self.bytes_read = 0
        self.files_opened: set[str] = set()

    def read(self, name: str, rows: slice | None = None) -> torch.Tensor:
        t = self._read(name, rows)
        self.bytes_read += t.numel() * t.element_size()
        return t

    def _read(self, name: str, rows: slice | None) -> torch.Tensor:
        raise NotImplementedError


class _DictReader(CheckpointReader):
    def __init__(self, state: Mapping[str, torch.Tensor], describe: str = "the state dict given"):
        self.state = state
        super().__init__({k: (tuple(v.shape), v.dtype) for k, v in state.items()}, describe)

    def _read(self, name, rows):
        t = self.state[name]
        return t if rows is None else t[rows]


class _SafetensorsReader(CheckpointReader):
    """One file or an HF index of shard files; a shard is opened when a tensor of it is read."""

    def __init__(self, files: dict[str, str], describe: str):
        from safetensors import safe_open

        self._open, self._handles, self.file_of = safe_open, {}, {}
        meta = {}
        for name, path in files.items():
            if path not in self._handles:
                self._handles[path] = safe_open(path, framework="pt", device="cpu")
            sl = self._handles[path].get_slice(name)
            meta[name] = (tuple(sl.get_shape()), _SAFETENSORS_DTYPES[sl.get_dtype()])
            self.file_of[name] = path
        super().__init__(meta, describe)

    def _read(self, name, rows):
        path = self.file_of[name]
        self.files_opened.add(path)
        handle = self._handles[path]
        if rows is None:
            return handle.get_tensor(name)
        return handle.get_slice(name)[rows]


def open_weights(weights) -> CheckpointReader:
    """A reader for ``weights`` (see the module docstring)."""
    if isinstance(weights, Mapping):
        return _DictReader(weights)
    path = os.fspath(weights)
    if os.path.isdir(path):
        index = os.path.join(path, INDEX)
        if os.path.exists(index):
            with open(index) as fh:
                weight_map = json.load(fh)["weight_map"]
            return _SafetensorsReader({k: os.path.join(path, f) for k, f in weight_map.items()}, f"{path}/{INDEX}")
        single = os.path.join(path, "model.safetensors")
        if os.path.exists(single):
            path = single
        else:
            raise ValueError(f"autopar: weights directory {path} has neither {INDEX} nor model.safetensors")
    if not os.path.exists(path):
        raise ValueError(f"autopar: weights file {path} does not exist")
    if path.endswith(".safetensors"):
        from safetensors import safe_open

        with safe_open(path, framework="pt", device="cpu") as f:
            names = list(f.keys())
        return _SafetensorsReader({k: path for k in names}, path)
    state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    if not isinstance(state, Mapping):
        raise ValueError(f"autopar: {path} holds a {type(state).__name__}, not a state dict of tensors")
    return _DictReader(state, path)


def lossless(src: torch.dtype, dst: torch.dtype) -> bool:
    """Whether every value of ``src`` converts exactly to ``dst``."""
    if src == dst:
        return True
    if src.is_floating_point and dst.is_floating_point:
        return torch.finfo(dst).bits >= torch.finfo(src).bits and not (
            {src, dst} == {torch.float16, torch.bfloat16})
    return False


def check_against(reader: CheckpointReader, expected: dict[str, tuple[tuple[int, ...], torch.dtype]],
                  aliases: dict[str, list[str]]) -> dict[str, str]:
    """The checkpoint name to read for every model name (tied names share one); ValueError with
    the first few problems otherwise. ``expected``: model name -> (whole shape, dtype);
    ``aliases``: canonical FQN -> every name of that tensor."""
    group = {n: names for names in aliases.values() for n in names}
    source, missing = {}, []
    for name in expected:
        names = group.get(name, [name])
        found = next((n for n in [name] + names if n in reader.meta), None)
        if found is None:
            missing.append(name)
        else:
            source[name] = found
    unexpected = [k for k in reader.meta if k not in expected]
    wrong = []
    for name, found in source.items():
        (shape, dtype), (cshape, cdtype) = expected[name], reader.meta[found]
        if tuple(shape) != tuple(cshape):
            wrong.append(f"{found}: shape {tuple(cshape)} in the checkpoint, {tuple(shape)} in the model")
        elif not lossless(cdtype, dtype):
            wrong.append(f"{found}: dtype {cdtype} in the checkpoint, {dtype} in the model (not convertible "
                         "without loss)")
    problems = []
    if missing:
        problems.append(f"{len(missing)} missing key(s), e.g. {missing[:4]}")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected key(s), e.g. {unexpected[:4]}")
    if wrong:
        problems.append(f"{len(wrong)} mismatch(es): " + "; ".join(wrong[:4]))
    if problems:
        raise ValueError(f"autopar: the weights in {reader.describe} do not fit the model: " + "; ".join(problems)
                         + ". Give a checkpoint saved from this model's architecture and configuration (keys are "
                         "the model's FQNs, as in model.state_dict())")
    return source
