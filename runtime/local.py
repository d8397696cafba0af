"""Local mode: every rank's action list runs in one process, in schedule order.

Ranks take turns: each turn runs the next action of every rank whose inputs are ready (an F
needs the previous stage's F of that microbatch, an I or B the next stage's I or B, a W its
own I). That is one valid interleaving of the per-rank orders, so local mode computes exactly
what the distributed runtime computes, with the same per-stage order of microbatches.
"""
from __future__ import annotations

import torch

from autopar.passes.split_backward import StageProgram

from .stage_work import StageWork


class LocalPipeline:
    """Runs a schedule's per-rank action lists over the stage programs, all in this process.

    ``state`` maps ``param:<fqn>`` / ``buffer:<fqn>`` / ``const:<name>`` keys to the live tensors;
    ``params`` maps canonical FQNs to the Parameters whose ``.grad`` receives the gradients.
    """

    def __init__(self, programs: list[StageProgram], schedule, state: dict, params: dict[str, torch.nn.Parameter],
                 transfers=None):
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
        self.work = StageWork(dict(enumerate(programs)), self.num_stages, state, params)
        self.executed: list[list[str]] = []  # per rank, the compute actions in the order they ran

    def run(self, microbatches: list[dict[str, torch.Tensor]], loss_scale: float) -> torch.Tensor:
        """One pass of the schedule over ``microbatches`` (each a dict data-key -> tensor).

        Gradients accumulate into ``params[...].grad``; buffers are updated in place after each
        F. Returns the sum over microbatches of ``loss * loss_scale``.
        """
        m = len(microbatches)
        if m != self.schedule.num_microbatches:
            raise ValueError(f"autopar: the schedule was built for {self.schedule.num_microbatches} microbatches, got {m}")
        work = self.work
        work.begin(microbatches, loss_scale)
        done: set[tuple[int, str, int]] = set()
        actions = [list(a) for a in self.schedule.actions]
        cursor = [0] * len(actions)
        self.executed = [[] for _ in actions]
        remaining = sum(len(a) for a in actions)
        while remaining:
            progressed = False
            for r, acts in enumerate(actions):
                while cursor[r] < len(acts):
                    a = acts[cursor[r]]
                    if not self._ready(a, done):
                        break
                    self._run(a)
                    done.add((a.stage, "B" if a.type in "IB" else a.type, a.microbatch))
                    self.executed[r].append(str(a))
                    cursor[r] += 1
                    remaining -= 1
                    progressed = True
            if not progressed:
                stuck = {r: str(acts[cursor[r]]) for r, acts in enumerate(actions) if cursor[r] < len(acts)}
                raise RuntimeError(f"autopar: schedule {self.schedule.name} cannot make progress; "
                                   f"next action per rank: {stuck}")
        return work.total_loss()

    def _run(self, a) -> None:
        work, s, k = self.work, a.stage, a.microbatch
        if a.type == "F":
            if ("F", s, k) in self._in_flight:
                work.put_inputs(s, k, self._in_flight.pop(("F", s, k)).wait())
            work.forward(s, k)
            outputs = work.take_outputs(s, k)
            if s + 1 < self.num_stages:
                if self._crosses(s, s + 1):
                    self._in_flight["F", s + 1, k] = self.transfers.copy(outputs)
                else:
                    work.put_inputs(s + 1, k, outputs)
        elif a.type in "IB":
            if ("B", s, k) in self._in_flight:
                work.put_grads(s, k, self._in_flight.pop(("B", s, k)).wait())
            (work.input_grads if a.type == "I" else work.full_backward)(s, k)
            gin = work.take_input_grads(s, k)
            if s > 0:
                if self._crosses(s, s - 1):
                    self._in_flight["B", s - 1, k] = self.transfers.copy(gin)
                else:
                    work.put_grads(s - 1, k, gin)
        elif a.type == "W":
            work.weight_grads(s, k)
        else:
            raise ValueError(f"autopar: local mode runs compute actions only, got {a}")

    def _crosses(self, s: int, t: int) -> bool:
        return self.transfers is not None and self.schedule.stage_to_rank[s] != self.schedule.stage_to_rank[t]

    def _ready(self, a, done) -> bool:
        s, k = a.stage, a.microbatch
        if a.type == "F":
            return s == 0 or (s - 1, "F", k) in done
        if a.type in "IB":
            return (s, "F", k) in done and (s == self.num_stages - 1 or (s + 1, "B", k) in done)
        if a.type == "W":
            return (s, "B", k) in done
        return False
