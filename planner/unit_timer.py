"""Device timing of a profile's units: every distinct unit's F, I and W programs run on real
tensors on this machine (``UnitTimer``), for a model on real CPU tensors priced on the measured
``cpu`` profile (planner/profile.py)."""
from __future__ import annotations

import logging
import time
from typing import Callable

import torch

from autopar.collectives import moe_exchange

from .programs import units_of

log = logging.getLogger("autopar")


class UnitTimer:
    """Times the F, I and W programs of every distinct unit of one profile on real tensors.

    State (parameters, buffers, constants) and data (model inputs, target) are the captured
    ones; received activations are random tensors of the traced shape and strides (zeros for
    integer ones), output gradients random tensors (the loss's the scalar scale). All units
    are timed together, round-robin (a warm-up round, then up to ``rounds`` rounds within about
    ``budget_s``, at least 3), so a drift in the machine's speed hits every unit alike; the
    median per program is kept. One intra-op thread, as each runtime process runs. ``entries``:
    the model's MoE experts entries, served while the programs run (collectives/moe_exchange.py)."""

    def __init__(self, state: dict, data: dict, entries: dict | None = None, rounds: int = 15,
                 budget_s: float = 1.0, compiled: bool = False):
        self.state, self.data, self.entries = state, data, dict(entries or {})
        self.compiled = compiled  # time the programs compiled by Inductor (the warm-up round compiles them)
        self.rounds, self.budget_s = rounds, budget_s
        self.units: list[tuple] = []
        self.result: list[tuple] | None = None
        self._second = None

    def add(self, sp, stage, loss_chunk: int = 0) -> Callable[[], tuple]:
        """Register a unit (``loss_chunk``: its loss chunked at that many tokens, the second size
        too); returns the function that gives its measurement: ((F, I, W) seconds at the captured
        microbatch, (F, I, W) at the second size or None, second size / first)."""
        self.units.append((sp, stage, loss_chunk))
        index = len(self.units) - 1
        return lambda: self.times(index)

    def times(self, index: int) -> tuple:
        if self.result is None:
            self.result = self._measure()
        return self.result[index]

    def second_batch(self, model, inputs: tuple, target, loss_fn, batch0: int, labels: list,
                     input_names=None) -> None:
        """Also time every unit at a second microbatch size (half the captured one, or twice it
        below 4 samples): the model is captured again at that size when the times are first
        asked for (only the measured cpu profile asks), and each unit's programs are split out
        of it at the same position. Two sizes give each program's fixed cost and per-sample
        cost; if the second capture does not cut into the same units, only the first is used."""
        b1 = batch0 // 2 if batch0 >= 4 else 2 * batch0

        def resize(x):
            if not isinstance(x, torch.Tensor) or x.dim() == 0 or x.shape[0] != batch0:
                return x
            return x[:b1] if b1 <= batch0 else torch.cat([x] * -(-b1 // batch0))[:b1]

        def build():
            from autopar.passes import expert_parallel, keys
            from autopar.passes.capture import capture
            from autopar.passes.chunked_loss import chunk_stage_loss
            from autopar.passes.split_backward import split_backward, stage_programs

            ins, tgt = tuple(resize(x) for x in inputs), resize(target)
            try:
                with expert_parallel.dispatch_form(model):
                    cap = capture(model, ins, tgt, loss_fn, input_names)
                _cuts, labels1, stages = units_of(cap)
            except Exception as e:  # noqa: BLE001 - the single-size measurement still stands
                log.info("autopar: second capture for unit timing failed (%s); timing one microbatch size", e)
                return None
            if labels1 != labels:
                return None
            wanted = {st.index for _sp, st, _c in self.units}
            trainable = set(cap.params.values())
            self.entries.update(moe_exchange.entries_of(model))  # this capture's experts entries, served by _measure
            with moe_exchange.serving(self.entries):
                progs = stage_programs(stages, trainable, held=wanted, stop_after=len(wanted),
                                       remake=None if self.compiled else ())  # as profile_model splits them

            def unit(st, chunk):
                if not chunk:
                    return progs[st.index], stages[st.index]
                requires = {n: True for n in progs[st.index - 1].diff_outputs} if st.index else {}
                chunked = chunk_stage_loss(stages[st.index], chunk)
                with moe_exchange.serving(self.entries):
                    return split_backward(chunked, requires, trainable, remake=self.compiled), chunked

            state = dict(self.state)
            state.update(keys.state({}, {}, cap.constants))
            data = dict(zip(cap.inputs, ins))
            if cap.target is not None:
                data[cap.target] = tgt
            return [unit(st, c) for _sp, st, c in self.units], state, data, b1 / batch0

        self._second = build

    def measure_again(self, budget_s: float) -> list[tuple]:
        if self.result is None:
            self.result = self._measure()
        saved = self.budget_s, self.rounds
        self.budget_s, self.rounds = budget_s, 5
        try:
            return self._measure(reuse=True)
        finally:
            self.budget_s, self.rounds = saved

    def _env(self, sp, stage, data: dict) -> dict:
        from autopar.passes import keys
        from autopar.runtime.stage_work import with_strides

        phs = {n.name: n.meta.get("val") for n in stage.gm.graph.nodes if n.op == "placeholder"}
        out_node = next(n for n in stage.gm.graph.nodes if n.op == "output")
        out_vals = dict(zip(stage.outputs, out_node.args[0]))

        def fresh(val, contiguous: bool):
            # what the runtime hands a program: gradients contiguous, activations in their traced
            # layout (StageWork.put_inputs), a broadcast dim (stride 0) expanded from one slice
            shape, dt = tuple(val.shape), val.dtype
            t = torch.randn(shape, dtype=dt) if dt.is_floating_point else torch.zeros(shape, dtype=dt)
            return t if contiguous else with_strides(t, tuple(val.stride()))

        env = {}
        for k in set(sp.f.args) | set(sp.i.args) | set(sp.w.args):
            if keys.is_kind(k, keys.DATA):
                env[k] = data[keys.name_of(k, keys.DATA)]
            elif keys.is_kind(k, keys.INPUT):
                env[k] = fresh(phs[keys.name_of(k, keys.INPUT)], contiguous=False)
            elif keys.is_kind(k, keys.GRAD):
                name = keys.name_of(k, keys.GRAD)
                env[k] = torch.tensor(1.0) if name == keys.LOSS else fresh(out_vals[name].meta["val"], contiguous=True)
        return env

    def _measure(self, reuse: bool = False) -> list[tuple]:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            if not reuse or not hasattr(self, "_second_built"):
                self._second_built = self._second() if self._second is not None else None
            with moe_exchange.serving(self.entries):  # the model's experts entries, both captures'
                return self._time(self._second_built)
        finally:
            torch.set_num_threads(threads)

    def _time(self, second) -> list[tuple]:
        from autopar.runtime.execute import run

        jobs = [(sp, stage, self.state, self.data) for sp, stage, _c in self.units]
        if second is not None:
            units1, state1, data1, ratio = second
            jobs += [(sp, stage, state1, data1) for sp, stage in units1]
        if self.compiled:
            from autopar.runtime.compiled import compiled_programs

            log.info("autopar planner: timing %d unit(s) compiled by Inductor: each F, I and W compiles once, in "
                     "the untimed first round (seconds to minutes, cold)", len(jobs))
            jobs = [(compiled_programs([sp], [0], label=f"unit {j} ")[0], stage, state, data)
                    for j, (sp, stage, state, data) in enumerate(jobs)]
        envs = [self._env(sp, stage, data) for sp, stage, _state, data in jobs]
        samples: list[list[tuple[float, float, float]]] = [[] for _ in jobs]
        t_end = time.perf_counter() + self.budget_s * (2 if second is not None else 1)
        for rnd in range(self.rounds + 1):
            for j, ((sp, _stage, state, _data), env0) in enumerate(zip(jobs, envs)):
                env = dict(env0)
                t0 = time.perf_counter()
                run(sp.f, env, state)
                t1 = time.perf_counter()
                run(sp.i, env, state)
                t2 = time.perf_counter()
                run(sp.w, env, state)
                t3 = time.perf_counter()
                if rnd:  # the first round warms up
                    samples[j].append((t1 - t0, t2 - t1, t3 - t2))
            if rnd >= 3 and time.perf_counter() > t_end:
                break
        med = [tuple(sorted(x[k] for x in smp)[len(smp) // 2] for k in range(3)) for smp in samples]
        n = len(self.units)
        if second is None:
            return [(m, None, 1.0) for m in med]
        return [(med[j], med[n + j], ratio) for j in range(n)]
