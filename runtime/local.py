"""Local mode: every rank's action list runs in one process, in schedule order.

Ranks take turns: each turn runs the next action of every rank whose inputs are ready (an F
needs the previous stage's F of that microbatch, an I or B the next stage's I or B, a W its
own I). That is one valid interleaving of the per-rank orders, so local mode computes exactly
what the distributed runtime computes, with the same per-stage order of microbatches.
"""
from __future__ import annotations

import torch

from autopar.passes.split_backward import LOSS, StageProgram, grad_key, input_key


class LocalPipeline:
    """Runs a schedule's per-rank action lists over the stage programs, all in this process.

    ``state`` maps ``param:<fqn>`` / ``buffer:<fqn>`` / ``const:<name>`` keys to the live tensors;
    ``params`` maps canonical FQNs to the Parameters whose ``.grad`` receives the gradients.
    """

    def __init__(self, programs: list[StageProgram], schedule, state: dict, params: dict[str, torch.nn.Parameter]):
        self.programs = programs
        self.schedule = schedule
        self.state = state
        self.params = params
        self.num_stages = len(programs)
        assert schedule.num_stages == self.num_stages, (schedule.num_stages, self.num_stages)
        self.executed: list[list[str]] = []  # per rank, the compute actions in the order they ran
        for s in range(1, self.num_stages):
            prev, cur = programs[s - 1], programs[s]
            assert set(cur.grad_inputs) == set(prev.diff_outputs), (s, cur.grad_inputs, prev.diff_outputs)

    def run(self, microbatches: list[dict[str, torch.Tensor]], loss_scale: float) -> torch.Tensor:
        """One pass of the schedule over ``microbatches`` (each a dict data-key -> tensor).

        Gradients accumulate into ``params[...].grad``; buffers are updated in place after each
        F. Returns the sum over microbatches of ``loss * loss_scale``.
        """
        m = len(microbatches)
        if m != self.schedule.num_microbatches:
            raise ValueError(f"autopar: the schedule was built for {self.schedule.num_microbatches} microbatches, got {m}")
        S = self.num_stages
        envs = {(s, k): {} for s in range(S) for k in range(m)}
        for k, mb in enumerate(microbatches):
            for s in range(S):
                for name in self.programs[s].stage.data:
                    envs[s, k][f"data:{name}"] = mb[name]
        last = self.programs[-1]
        scale = None
        losses: list[torch.Tensor | None] = [None] * m
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
                    env = envs[a.stage, a.microbatch]
                    prog = self.programs[a.stage]
                    if a.type == "F":
                        losses[a.microbatch] = self._forward(prog, env, envs, a)
                        if prog is last:
                            if scale is None:
                                loss = losses[a.microbatch]
                                scale = torch.full((), loss_scale, dtype=loss.dtype, device=loss.device)
                            env[grad_key(LOSS)] = scale
                    elif a.type == "I":
                        prog.i(env, self.state)
                        self._send_grads(prog, env, envs, a)
                        _release(env, prog.keys_after("I"))
                    elif a.type == "W":
                        prog.w(env, self.state)
                        self._accumulate(prog, env)
                        env.clear()
                    elif a.type == "B":
                        prog.b(env, self.state)
                        self._send_grads(prog, env, envs, a)
                        self._accumulate(prog, env)
                        env.clear()
                    else:
                        raise ValueError(f"autopar: local mode runs compute actions only, got {a}")
                    done.add((a.stage, "B" if a.type in "IB" else a.type, a.microbatch))
                    if a.type == "W":
                        done.add((a.stage, "W", a.microbatch))
                    self.executed[r].append(str(a))
                    cursor[r] += 1
                    remaining -= 1
                    progressed = True
            if not progressed:
                stuck = {r: str(acts[cursor[r]]) for r, acts in enumerate(actions) if cursor[r] < len(acts)}
                raise RuntimeError(f"autopar: schedule {self.schedule.name} cannot make progress; "
                                   f"next action per rank: {stuck}")
        total = losses[0] * loss_scale
        for loss in losses[1:]:
            total = total + loss * loss_scale
        return total.detach()

    def _ready(self, a, done) -> bool:
        s, k = a.stage, a.microbatch
        if a.type == "F":
            return s == 0 or (s - 1, "F", k) in done
        if a.type in "IB":
            return (s, "F", k) in done and (s == self.num_stages - 1 or (s + 1, "B", k) in done)
        if a.type == "W":
            return (s, "B", k) in done
        return False

    def _forward(self, prog: StageProgram, env, envs, a):
        prog.f(env, self.state)
        stage = prog.stage
        for fqn in stage.buffer_updates:
            buf = self.state[f"buffer:{fqn}"]
            with torch.no_grad():
                buf.copy_(env.pop(f"update:{fqn}"))
        loss = env.pop(LOSS, None)
        if a.stage + 1 < self.num_stages:
            nxt = envs[a.stage + 1, a.microbatch]
            strides = self.programs[a.stage + 1].input_strides
            for name in stage.outputs:
                nxt[input_key(name)] = _with_strides(env.pop(f"out:{name}"), strides[name])
        else:
            for name in stage.outputs:
                env.pop(f"out:{name}")
        _release(env, prog.keys_after("F"))
        return loss

    def _send_grads(self, prog: StageProgram, env, envs, a):
        if a.stage == 0:
            for name in prog.grad_inputs:
                env.pop(f"gin:{name}")
            return
        prev = envs[a.stage - 1, a.microbatch]
        for name in prog.grad_inputs:
            prev[grad_key(name)] = env.pop(f"gin:{name}").contiguous()

    def _accumulate(self, prog: StageProgram, env):
        for fqn in prog.grad_params:
            g = env.pop(f"gparam:{fqn}")
            p = self.params[fqn]
            if p.grad is None:
                p.grad = g.detach().clone(memory_format=torch.contiguous_format)
            else:
                p.grad.add_(g)


def _with_strides(t: torch.Tensor, strides: tuple[int, ...]) -> torch.Tensor:
    """`t` in the memory layout the receiving stage was traced with (a copy only if it differs)."""
    if t.stride() == strides or t.numel() <= 1:
        return t
    out = torch.empty_strided(t.shape, strides, dtype=t.dtype, device=t.device)
    out.copy_(t)
    return out


def _release(env: dict, keep: frozenset[str]) -> None:
    """Drop every key of a microbatch env that no later program of that microbatch reads."""
    for k in [k for k in env if k not in keep]:
        del env[k]
