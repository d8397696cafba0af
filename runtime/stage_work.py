"""The compute side of one step, shared by the local and the distributed executors.

``StageWork`` owns one env dict per (stage, microbatch) and runs the F/I/W/B programs on it.
Executors only decide *when* each action runs and how activations and gradients move
between stages (in-process hand-off or P2P): they deposit received values with
``put_inputs``/``put_grads`` and take values to send with ``take_outputs``/``take_input_grads``.
"""
from __future__ import annotations

import torch
from torch.profiler import record_function

from autopar.collectives.moe_exchange import fused_backward
from autopar.passes import keys
from autopar.passes.program import StageProgram

from .execute import run, run_paired, start


class ParamGrads:
    """Where gradients accumulate: each tensor's ``.grad`` (created zeroed at its first use in a
    step). The data-parallel owner passes one over fp32 masters under mixed precision."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors

    def accumulator(self, fqn: str) -> torch.Tensor:
        p = self.tensors[fqn]
        if p.grad is None:
            p.grad = torch.zeros_like(p, memory_format=torch.contiguous_format)
        return p.grad

    def add(self, fqn: str, g: torch.Tensor) -> None:
        p = self.tensors[fqn]
        if p.grad is None:
            # a copy: g may alias a tangent that is also sent upstream (out = x + p gives
            # grad_p is grad_x), and .grad is accumulated into in place
            p.grad = g.to(p.dtype).clone(memory_format=torch.contiguous_format)
        else:
            p.grad.add_(g)

    def zero(self) -> None:
        for p in self.tensors.values():
            p.grad = None


class StageWork:
    def __init__(self, programs: dict[int, StageProgram], num_stages: int, state: dict, grads, grad_sink=None):
        """``grads``: where parameter gradients accumulate (a ParamGrads; a dict of Parameters
        means their ``.grad``)."""
        self.programs = programs  # stage index -> program (a rank holds some of the stages)
        self.num_stages = num_stages
        self.state = state
        self.grads = grads if hasattr(grads, "accumulator") else ParamGrads(grads)
        self.envs: dict[tuple[int, int], dict] = {}
        self.losses: dict[int, torch.Tensor] = {}
        self._scale: dict = {}  # loss scale -> its 0-dim tangent tensor, per step
        # grad_sink(fqn, grad) -> True when it took the gradient (ZeRO-2/3 flat buffers)
        self.grad_sink = grad_sink
        self._grad_keys = {s: tuple(keys.gparam(fqn) for fqn in prog.grad_params) for s, prog in programs.items()}
        self.offload = None  # runtime/offload.ActivationOffload: saved values parked on the host between F and I/W

    def begin(self, microbatches: list[dict[str, torch.Tensor]], loss_scale) -> None:
        """Start a step: data keys for every held stage and microbatch, the loss tangent.
        ``loss_scale``: one factor for every microbatch's loss, or one per microbatch."""
        self.envs = {}
        self.losses = {}
        n = len(microbatches)
        self._loss_scale = list(loss_scale) if isinstance(loss_scale, (list, tuple)) else [loss_scale] * n
        assert len(self._loss_scale) == n, (len(self._loss_scale), n)
        self._scale = {}
        if self.offload is not None:
            self.offload.new_step(self.state)
        for k, mb in enumerate(microbatches):
            for s, prog in self.programs.items():
                self.envs[s, k] = {keys.data(name): mb[name] for name in prog.stage.data}

    # -- compute ---------------------------------------------------------------------------

    def forward(self, s: int, k: int, train: bool = True) -> None:
        """Stage s's F on microbatch k. ``train=False`` (evaluation): nothing is kept for a
        backward and buffers are not updated."""
        with record_function(f"{s}F{k}"):
            _drain(self._forward(s, k, train, paused=False))

    def input_grads(self, s: int, k: int) -> None:
        with record_function(f"{s}I{k}"):
            _drain(self._input_grads(s, k, paused=False))

    def weight_grads(self, s: int, k: int) -> None:
        prog, env = self.programs[s], self.envs[s, k]
        if self.offload is not None:
            self.offload.before(s, k, env, "W")
        with record_function(f"{s}W{k}"):
            _drain(self._gradients(s, prog.w, env, paused=False))
        _release(env, frozenset({"__gin__", "__outputs__"}))

    def full_backward(self, s: int, k: int) -> None:
        with record_function(f"{s}B{k}"):
            _drain(self._full_backward(s, k, paused=False))

    def forward_backward(self, sf: int, kf: int, sb: int, kb: int, kind: str) -> None:
        """An F&B unit (DualPipeV): stage sf's F on microbatch kf and stage sb's I or B (``kind``)
        on microbatch kb, run alternately at the points where one leaves an all-to-all in
        flight (runtime/execute.py ``run_paired``), so each one's MoE dispatch is hidden behind
        the other's compute. Values and order of each program are those of running them apart."""
        back = self._input_grads(sb, kb, paused=True) if kind == "I" else self._full_backward(sb, kb, paused=True)
        with record_function(f"{sf}F{kf}&{sb}{kind}{kb}"):
            run_paired(self._forward(sf, kf, True, paused=True), back)

    def _forward(self, s: int, k: int, train: bool, paused: bool):
        prog, env = self.programs[s], self.envs[s, k]
        keep = prog.keys_after("F") if train else _NOTHING
        yield from _run(paused, prog.f, env, self.state, keep=keep)
        for fqn in prog.stage.buffer_updates:
            update = env.pop(keys.update(fqn))
            if train:
                with torch.no_grad():
                    self.state[keys.buffer(fqn)].copy_(update)
        if prog.stage.has_loss:
            loss = env.pop(keys.LOSS)
            self.losses[k] = loss
            if train:
                scale = self._scale.get(self._loss_scale[k])
                if scale is None:  # one tensor per distinct factor
                    scale = self._scale[self._loss_scale[k]] = torch.full((), self._loss_scale[k], dtype=loss.dtype,
                                                                          device=loss.device)
                env[keys.grad(keys.LOSS)] = scale
        outputs = {name: env.pop(keys.out(name)) for name in prog.stage.outputs}
        _release(env, keep)
        env["__outputs__"] = outputs  # until taken by the executor (hand-off or send)
        if train and self.offload is not None:
            self.offload.after_forward(s, k, env)

    def _input_grads(self, s: int, k: int, paused: bool):
        prog, env = self.programs[s], self.envs[s, k]
        if self.offload is not None:
            self.offload.before(s, k, env, "I")
        yield from _run(paused, prog.i, env, self.state, keep=prog.keys_after("I"))
        gin = {name: env.pop(keys.gin(name)) for name in prog.grad_inputs}
        _release(env, prog.keys_after("I") | {"__outputs__"})
        env["__gin__"] = gin

    def _full_backward(self, s: int, k: int, paused: bool):
        prog, env = self.programs[s], self.envs[s, k]
        if self.offload is not None:
            self.offload.before(s, k, env, "B")
        with fused_backward():
            yield from self._gradients(s, prog.b, env, paused)
        gin = {name: env.pop(keys.gin(name)) for name in prog.grad_inputs}
        _release(env, frozenset({"__outputs__"}))
        env["__gin__"] = gin

    def _gradients(self, s: int, program, env: dict, paused: bool):
        """Run stage s's W or B. Without a grad_sink it adds every parameter gradient into its
        accumulator (zeroed at the first microbatch), a linear layer's inside its weight-gradient
        GEMM when the dtypes agree (passes/exec_code.py), so no fresh gradient lives beside the
        accumulator. With one (ZeRO-2/3 flat buffers), the fresh gradients go to the sink."""
        prog = self.programs[s]
        if self.grad_sink is not None:
            yield from _run(paused, program, env, self.state, keep=_NOTHING)
            self._accumulate(prog, env)
            return
        into = [self.grads.accumulator(fqn) for fqn in prog.grad_params]
        yield from _run(paused, program, env, self.state, self._grad_keys[s], into, keep=_NOTHING)

    def _accumulate(self, prog: StageProgram, env: dict) -> None:
        """Fresh gradients into the grad_sink, or (parameters it does not take) into ``grads``."""
        for fqn in prog.grad_params:
            g = env.pop(keys.gparam(fqn))
            if not self.grad_sink(fqn, g):
                self.grads.add(fqn, g)

    # -- moving values -----------------------------------------------------------------------

    def take_outputs(self, s: int, k: int) -> dict[str, torch.Tensor]:
        return self.envs[s, k].pop("__outputs__")

    def take_input_grads(self, s: int, k: int) -> dict[str, torch.Tensor]:
        return self.envs[s, k].pop("__gin__")

    def put_inputs(self, s: int, k: int, values: dict[str, torch.Tensor]) -> None:
        strides = self.programs[s].input_strides
        env = self.envs[s, k]
        for name, t in values.items():
            env[keys.input(name)] = with_strides(t, strides[name])

    def put_grads(self, s: int, k: int, values: dict[str, torch.Tensor]) -> None:
        env = self.envs[s, k]
        for name, g in values.items():
            env[keys.grad(name)] = g.contiguous()

    def total_loss(self) -> torch.Tensor | None:
        """Sum over microbatches of loss * scale, in microbatch order (None off the last stage)."""
        if not self.losses:
            return None
        total = None
        for k in sorted(self.losses):
            term = self.losses[k].float() * self._loss_scale[k]  # fp32 even when the loss is bf16
            total = term if total is None else total + term
        return total.detach()


_NOTHING = frozenset()  # after W or B, no program of the microbatch reads its env


def _run(paused: bool, *args, **kwargs):
    """A program run as a generator: pausing where it leaves communication in flight
    (``paused``), or whole at the first ``next``."""
    if paused:
        yield from start(*args, **kwargs)
    else:
        run(*args, **kwargs)


def _drain(gen) -> None:
    for _ in gen:
        pass


def with_strides(t: torch.Tensor, strides: tuple[int, ...]) -> torch.Tensor:
    """`t` in the memory layout the receiving stage was traced with (a copy only if it differs).
    A dim traced as a broadcast (stride 0) is rebuilt from one slice, then expanded again."""
    if t.stride() == strides or t.numel() <= 1:
        return t
    bcast = [d for d, (n, s) in enumerate(zip(t.shape, strides)) if s == 0 and n > 1]
    if bcast:
        one = t[tuple(slice(0, 1) if d in bcast else slice(None) for d in range(t.dim()))]
        return with_strides(one, tuple(strides)).expand(t.shape)
    out = torch.empty_strided(t.shape, strides, dtype=t.dtype, device=t.device)
    out.copy_(t)
    return out


def _release(env: dict, keep: frozenset[str]) -> None:
    """Drop every key of a microbatch env that no later program of that microbatch reads."""
    for key in [key for key in env if key not in keep]:
        del env[key]
