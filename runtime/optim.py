"""The optimizer ``pm.optimizer`` is: a ``torch.optim.Optimizer`` under every ZeRO level.

Without ZeRO and mixed precision it is the user's own optimizer over this process's
parameters. Otherwise the user's optimizer steps something else (fp32 masters, flat ZeRO
shards) and a ``WrappedOptimizer`` around it is what ``pm.optimizer`` returns: its
``param_groups`` and ``state`` are the inner optimizer's own objects, so a
``torch.optim.lr_scheduler`` that changes ``lr`` changes the update, and ``state_dict()`` /
``load_state_dict()`` are the inner optimizer's (ZeRO states are this replica's shards).
``step()`` steps the inner optimizer, then brings the stepped values to where the programs read
parameters (the subclass's ``_after_step``, then ``casts``: the fp32 masters stepped whole under
mixed precision, every one of them without ZeRO, the expert shards stepped whole beside the ZeRO
shards otherwise, cast into their compute copies).
"""
from __future__ import annotations

import torch


class WrappedOptimizer(torch.optim.Optimizer):
    def __init__(self, inner: torch.optim.Optimizer, casts: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None):
        """``casts``: FQN -> (an fp32 master the inner optimizer steps whole, the compute copy
        the programs read), copied after every step."""
        super().__init__(inner.param_groups, inner.defaults)  # torch's bookkeeping (hooks)
        self.inner = inner
        self.casts = dict(casts or {})
        self._share()

    def _share(self) -> None:
        self.param_groups = self.inner.param_groups
        self.state = self.inner.state

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("autopar: the optimizer steps once per pm.step(); closures are not supported")
        self.inner.step()
        self._after_step()
        for master, compute in self.casts.values():
            compute.copy_(master)

    def _after_step(self) -> None:
        """Bring the stepped values to where the programs read parameters (none to move: the
        masters are the optimizer's own parameters, cast by ``casts``)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.inner!r})"

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return self.inner.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.inner.load_state_dict(state_dict)
        self._share()
