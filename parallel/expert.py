"""Expert parallelism: each of ``ep`` ranks holds ``E / ep`` experts of every MoE block.

``ExpertParallel`` owns the module rewrite (passes/expert_parallel.py: experts sharded, the
expert buffer moved by all-to-all; done before capture, so the captured graph holds the
all-to-alls and the joint trace their backward), which parameters are expert shards (the data
parallel owner reduces their gradients over the expert-data-parallel group, the replicas
holding the same experts, and ZeRO-shards them over it: parallel/data.py) and their state
mapping: an expert parameter's whole value is its ``ep`` shards concatenated along dim 0 in
EP rank order (for checkpoints: one contiguous range of the whole tensor's row-major elements,
``local_shards``; the data-parallel owner's ZeRO pieces are ranges of that range). A shard
ZeRO-3 freed (its values live in the data-parallel owner's master shards) is left to that
owner by ``whole`` and ``load_whole``. Blocks: ``autopar.nn.MoE`` (capacity,
drops like the single-process block) and Hugging Face transformers MoE blocks (dropless,
passes/hf_moe.py); the parameter FQNs stay the model's own.
"""
from __future__ import annotations

import logging
import math

import torch

from autopar.collectives import comms
from autopar.passes.expert_parallel import apply_expert_parallel, check_expert_parallel

from .base import Parallelism, Shard

log = logging.getLogger("autopar")


class ExpertParallel(Parallelism):
    name = "ep"

    def __init__(self, *, ep: int, mesh):
        self.ep, self.mesh = ep, mesh
        self.shards: dict = {}  # fqn -> passes.expert_parallel.ExpertShard
        self.model = None

    @staticmethod
    def check_module(model, ep: int) -> None:
        """ValueError, before any process group exists, when ``model`` has no MoE block EP can
        shard, a block EP refuses (it is named, with what was expected), or an expert count
        that ``ep`` does not divide. Pure: the orchestrator may call it before the mesh."""
        check_expert_parallel(model, ep)

    def rewrite_module(self, model) -> None:
        fold = self.mesh.tp if self.mesh.folded else 1
        self.shards = apply_expert_parallel(model, self.ep, self.mesh.ep_rank, self.mesh.ep_group,
                                            self.mesh.tp_group if fold > 1 else None, fold)
        self.model = model
        self.sharded = frozenset(self.shards)
        log.info("autopar: expert parallel over %d ranks: %d expert parameters sharded", self.ep, len(self.shards))

    @property
    def params(self) -> dict[str, torch.nn.Parameter]:
        """The local shards, looked up now (materializing a meta model replaces Parameters)."""
        named = dict(self.model.named_parameters())
        return {f: named[f] for f in self.shards}

    def _held(self) -> dict[str, torch.nn.Parameter]:
        """The shards this process holds whole (not freed by ZeRO-3, whose data-parallel owner
        gathers and loads those): alike on every rank of the EP group."""
        return {f: p for f, p in self.params.items() if not p.is_meta and tuple(p.shape) == self.shards[f].local_shape}

    def whole(self) -> dict:
        return {f: comms.all_gather_dim0(p.detach().contiguous(), self.mesh.ep_group) for f, p in self._held().items()}

    def load_whole(self, values: dict) -> None:
        for f, shard in self.shards.items():
            full = values[f]
            if tuple(full.shape) != tuple(shard.full_shape):
                raise ValueError(f"autopar: {f} has shape {tuple(full.shape)} in the state dict, the model's is "
                                 f"{tuple(shard.full_shape)}")
        with torch.no_grad():
            for f, p in self._held().items():
                p.copy_(values[f][self.shards[f].rows])

    def local_shards(self) -> dict[str, list[Shard]]:
        """Checkpoints: FQN -> where this rank's expert shard lies in the whole tensor (rows
        ``shard.rows`` of dim 0 are one contiguous range of its row-major elements)."""
        out = {}
        for f, p in self.params.items():
            sh = self.shards[f]
            assert sh.dim == 0, (f, sh.dim)  # rows of dim 0 are contiguous in the whole
            row = math.prod(sh.full_shape[1:])
            out[f] = [Shard(sh.rows.start * row, sh.rows.stop * row, tuple(sh.full_shape), p)]
        return out
