"""Local mode: every rank's action list runs in one process, in schedule order.

Ranks take turns: each turn runs the next action of every rank whose inputs are ready (the
dependency rule of schedules/deps.py). That is one valid interleaving of the per-rank orders,
and each action runs as the same primitive calls as in the distributed runtime
(runtime/actions.py), so local mode computes exactly what the distributed runtime computes,
with the same per-stage order of microbatches.
"""
from __future__ import annotations

import torch

from autopar.passes.program import StageProgram
from autopar.schedules.deps import Key, needs, produces
from autopar.schedules.ir import forward_only

from .actions import run_action, unit_calls
from .execute import pauses
from .stage_work import StageWork


class LocalPipeline:
    """Runs a schedule's per-rank action lists over the stage programs, all in this process.

    ``state`` maps ``param:<fqn>`` / ``buffer:<fqn>`` / ``const:<name>`` keys to the live tensors;
    ``grads`` is where the gradients accumulate (a runtime/stage_work.ParamGrads, or a dict of
    canonical FQN -> Parameter, whose ``.grad`` then receives them).
    """

    def __init__(self, programs: list[StageProgram], schedule, state: dict, grads, transfers=None):
        self.programs = programs
        # runtime/streams.CommStream or None: values crossing pipeline ranks are copied on its
        # side stream and waited for by their consumer (a stand-in for P2P on one device)
        self.transfers = transfers
        self._in_flight: dict = {}
        self.schedule = schedule
        self.num_stages = len(programs)
        assert schedule.num_stages == self.num_stages, (schedule.num_stages, self.num_stages)
        for s in range(1, self.num_stages):
            prev, cur = programs[s - 1], programs[s]
            assert set(cur.grad_inputs) == set(prev.diff_outputs), (s, cur.grad_inputs, prev.diff_outputs)
        self.work = StageWork(dict(enumerate(programs)), self.num_stages, state, grads)
        self.executed: list[list[str]] = []  # per rank, the compute actions in the order they ran
        self.training = True
        self._units = [self.units(r) for r in range(schedule.pp)]  # F&B units run interleaved, per rank

    def run(self, microbatches: list[dict[str, torch.Tensor]], loss_scale: float, train: bool = True) -> torch.Tensor:
        """One pass of the schedule over ``microbatches`` (each a dict data-key -> tensor).

        Gradients accumulate into ``grads``; buffers are updated in place after each F. Returns
        the sum over microbatches of ``loss * loss_scale``. ``train=False``: the forwards only
        (an evaluation: nothing kept for a backward, no buffer updated).
        """
        m = len(microbatches)
        if m != self.schedule.num_microbatches:
            raise ValueError(f"autopar: the schedule was built for {self.schedule.num_microbatches} microbatches, "
                             f"got {m}")
        self.work.begin(microbatches, loss_scale)
        self.training = train
        schedule = self.schedule if train else forward_only(self.schedule)
        owner = schedule.stage_to_rank
        done: set[Key] = set()  # the values computed so far
        actions = [list(a) for a in schedule.actions]
        paired = self._units if train else [frozenset()] * len(actions)
        cursor = [0] * len(actions)
        self.executed = [[] for _ in actions]
        remaining = sum(len(a) for a in actions)
        while remaining:
            progressed = False
            for r, acts in enumerate(actions):
                while cursor[r] < len(acts):
                    a = acts[cursor[r]]
                    unit = acts[cursor[r]: cursor[r] + 2] if cursor[r] in paired[r] else [a]
                    if not all(self._ready(x, done) for x in unit):
                        break
                    if len(unit) == 2:
                        for c in unit_calls(*unit, owner, r):
                            getattr(self, c.primitive)(*c.args)
                    else:
                        run_action(self, a, owner, r)
                    for x in unit:
                        done.update(produces(x))
                        self.executed[r].append(str(x))
                    cursor[r] += len(unit)
                    remaining -= len(unit)
                    progressed = True
            if not progressed:
                stuck = {r: str(acts[cursor[r]]) for r, acts in enumerate(actions) if cursor[r] < len(acts)}
                raise RuntimeError(f"autopar: schedule {schedule.name} cannot make progress; "
                                   f"next action per rank: {stuck}")
        return self.work.total_loss()

    def _ready(self, a, done: set[Key]) -> bool:
        """Every input of compute action ``a`` exists; a communication action never runs here."""
        return a.is_compute and all(need in done for need in needs(a, self.num_stages))

    # -- primitives (runtime/actions.py calls them) ------------------------------------------
    # A value crossing pipeline ranks is handed over in place, or, with ``transfers``, copied
    # on the side stream at its producer and waited for by its consumer's wait_f / wait_b.

    def wait_f(self, s: int, k: int) -> None:
        """Stage s's inputs for microbatch k from another rank, once their copy landed."""
        if self.transfers is not None:
            self.work.put_inputs(s, k, self._in_flight.pop(("F", s, k)).wait())

    def wait_b(self, s: int, k: int) -> None:
        """The gradients of stage s's outputs for microbatch k from another rank, once copied."""
        if self.transfers is not None:
            self.work.put_grads(s, k, self._in_flight.pop(("B", s, k)).wait())

    def units(self, r: int) -> frozenset[int]:
        """Positions of rank r's F&B units that run interleaved (runtime/distributed.py ``_units``)."""
        progs = [p for s, p in enumerate(self.programs) if self.schedule.stage_to_rank[s] == r]
        return frozenset(self.schedule.overlaps(r)) if pauses(progs) else frozenset()

    def forward_backward(self, sf: int, kf: int, sb: int, kb: int, kind: str) -> None:
        self.work.forward_backward(sf, kf, sb, kb, kind)
        self._forwarded(sf, kf)
        self._backwarded(sb, kb)

    def forward(self, s: int, k: int) -> None:
        self.work.forward(s, k, train=self.training)
        self._forwarded(s, k)

    def _forwarded(self, s: int, k: int) -> None:
        outputs = self.work.take_outputs(s, k)
        if s + 1 < self.num_stages:
            if self._crosses(s, s + 1):
                self._in_flight["F", s + 1, k] = self.transfers.copy(outputs)
            else:
                self.work.put_inputs(s + 1, k, outputs)

    def backward(self, s: int, k: int, kind: str) -> None:
        """kind "I" (input grads only) or "B" (input and weight grads)."""
        (self.work.input_grads if kind == "I" else self.work.full_backward)(s, k)
        self._backwarded(s, k)

    def _backwarded(self, s: int, k: int) -> None:
        gin = self.work.take_input_grads(s, k)
        if s > 0:
            if self._crosses(s, s - 1):
                self._in_flight["B", s - 1, k] = self.transfers.copy(gin)
            else:
                self.work.put_grads(s - 1, k, gin)

    def weight(self, s: int, k: int) -> None:
        self.work.weight_grads(s, k)

    def _crosses(self, s: int, t: int) -> bool:
        return self.transfers is not None and self.schedule.stage_to_rank[s] != self.schedule.stage_to_rank[t]
