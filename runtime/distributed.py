"""Distributed mode: this process runs its pipeline rank's lowered action list.

Mesh: global rank = dp_rank * pp + pp_rank (the ranks of one pipeline replica are
contiguous). Activations and gradients move by tagged isend/irecv; a receive is posted where
the lowered schedule puts its RECV and waited on just before the compute that reads it;
sends complete in the background and are waited on at the end of the step. After the last
action: tied parameters' gradients are summed over the pipeline ranks that hold them, then
every gradient is summed over the dp replicas (each microbatch loss was already scaled by
1/(dp*m), so the sum is the average: divided once).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch

from autopar.passes.split_backward import LOSS, StageInfo, StageProgram

from . import comms
from .grad_reduce import BucketedReducer, naive_all_reduce
from .stage_work import StageWork


@dataclass
class Mesh:
    pp: int
    dp: int
    rank: int
    pp_group: object = None
    dp_group: object = None
    tied_groups: dict = field(default_factory=dict)  # canonical fqn -> group of the pp ranks holding it

    @property
    def pp_rank(self) -> int:
        return self.rank % self.pp

    @property
    def dp_rank(self) -> int:
        return self.rank // self.pp

    def global_rank(self, pp_rank: int) -> int:
        """Global rank of pipeline rank `pp_rank` in this process's replica."""
        return self.dp_rank * self.pp + pp_rank


def build_mesh(pp: int, dp: int, stages, trainable: set[str], stage_to_rank, timeout: timedelta) -> Mesh:
    """Create every process group (all ranks call this in the same order)."""
    rank, world = comms.world()
    assert pp * dp == world, (pp, dp, world)
    mesh = Mesh(pp=pp, dp=dp, rank=rank)
    for d in range(dp):
        ranks = [d * pp + r for r in range(pp)]
        g = comms.new_group(ranks, timeout) if pp > 1 else None
        if d == mesh.dp_rank:
            mesh.pp_group = g
    for r in range(pp):
        ranks = [d * pp + r for d in range(dp)]
        g = comms.new_group(ranks, timeout) if dp > 1 else None
        if r == mesh.pp_rank:
            mesh.dp_group = g
    # Every rank must derive the same groups: use what every rank knows of every stage (the
    # trainable parameters it uses), not the gradients only a stage's own rank traced.
    holders: dict[str, set[int]] = {}
    for st in stages:
        for fqn in st.params:
            if fqn in trainable:
                holders.setdefault(fqn, set()).add(stage_to_rank[st.index])
    for fqn in sorted(holders):
        owners = sorted(holders[fqn])
        if len(owners) < 2:
            continue
        for d in range(dp):
            g = comms.new_group([d * pp + r for r in owners], timeout)
            if d == mesh.dp_rank and mesh.pp_rank in owners:
                mesh.tied_groups[fqn] = g
    return mesh


class PeerTimeout(RuntimeError):
    pass


class DistributedPipeline:
    """Runs this rank's lowered actions; same results as LocalPipeline for the same schedule."""

    def __init__(self, programs: list[StageProgram | StageInfo], schedule, lowered, state: dict,
                 params: dict[str, torch.nn.Parameter], mesh: Mesh, timeout: timedelta, device: torch.device,
                 grad_reduce: str = "bucketed", bucket_bytes: int = 25 * 2**20):
        self.programs = programs
        self.schedule = schedule
        self.lowered = lowered
        self.mesh = mesh
        self.timeout = timeout
        self.device = device
        self.owner = schedule.stage_to_rank
        self.my_stages = [s for s in range(schedule.num_stages) if self.owner[s] == mesh.pp_rank]
        self.work = StageWork({s: programs[s] for s in self.my_stages}, schedule.num_stages, state, params)
        self.params = params
        self.my_params = sorted({f for s in self.my_stages for f in programs[s].grad_params})
        self.executed: list[str] = []
        self.position = "not started"
        self.step_index = 0
        self._m = schedule.num_microbatches
        if grad_reduce not in ("bucketed", "naive", "zero1"):
            raise ValueError(f"autopar: grad_reduce must be 'bucketed' or 'naive', got {grad_reduce!r}")
        self.grad_reduce = grad_reduce  # "zero1": the ZeRO-1 optimizer reduce-scatters in its step
        self.reducer = None
        if mesh.dp > 1 and grad_reduce == "bucketed":
            self.reducer = BucketedReducer(params, {s: list(programs[s].grad_params) for s in self.my_stages},
                                           mesh.dp_group, bucket_bytes, deferred=set(mesh.tied_groups))
        self.program = None  # generated step function (runtime/codegen.py); None = interpret
        self._in_specs = {s: _input_specs(programs[s]) for s in self.my_stages}
        self._grad_specs = {s: _grad_specs(programs[s]) for s in self.my_stages}

    # -- one step ----------------------------------------------------------------------------
    # The step is a sequence of calls to the primitives below, one (or two: a wait, then the
    # compute) per lowered action. `interpret` walks the action list; `generate` writes the same
    # calls out as straight-line Python (runtime/codegen.py). Both must give identical results.

    def run(self, microbatches: list[dict[str, torch.Tensor]], loss_scale: float) -> torch.Tensor:
        self.work.begin(microbatches, loss_scale)
        self._wb_done: dict[int, int] = {}
        if self.reducer is not None:
            self.reducer.reset()
        self._pending: dict[tuple[str, int, int], comms.PendingRecv] = {}
        self._sends: list = []
        self.executed = []
        try:
            if self.program is not None:
                self.program(self)
            else:
                interpret(self, self.lowered.actions[self.mesh.pp_rank])
            assert not self._pending, f"receives never consumed: {sorted(self._pending)}"
            self.at("waiting for sends to finish")
            for w, _t in self._sends:
                w.wait(self.timeout)
            self.at("gradient reduction")
            self._sync_grads()
            loss = self._broadcast_loss(self.work.total_loss())
        except (RuntimeError, ValueError) as e:
            if isinstance(e, PeerTimeout):
                raise
            raise PeerTimeout(self._failure_report(f"failed with {type(e).__name__}: {str(e).splitlines()[0][:300]}")) from e
        self.at("done")
        self.step_index += 1
        return loss

    def at(self, what: str) -> None:
        self.position = f"step {self.step_index}, {what}"

    def recv_f(self, s: int, k: int) -> None:
        """Post the receive of stage s's input activations for microbatch k."""
        peer = self.mesh.global_rank(self.owner[s - 1])
        bufs = {n: torch.empty(shape, dtype=dt, device=self.device) for n, (shape, dt) in self._in_specs[s].items()}
        tags = [comms.p2p_tag(s - 1, k, False, i, self._m) for i in range(len(bufs))]
        self._pending["F", s, k] = comms.irecv(bufs, peer, tags, what=f"activations from {s - 1}F{k}")

    def recv_b(self, s: int, k: int) -> None:
        """Post the receive of the gradients of stage s's outputs for microbatch k."""
        peer = self.mesh.global_rank(self.owner[s + 1])
        bufs = {n: torch.empty(shape, dtype=dt, device=self.device) for n, (shape, dt) in self._grad_specs[s].items()}
        tags = [comms.p2p_tag(s + 1, k, True, i, self._m) for i in range(len(bufs))]
        self._pending["B", s, k] = comms.irecv(bufs, peer, tags, what=f"gradients from {s + 1}I{k}")

    def wait_f(self, s: int, k: int) -> None:
        self.at(f"waiting for {s}RECV_F{k}")
        self.work.put_inputs(s, k, self._wait(self._pending.pop(("F", s, k))))

    def wait_b(self, s: int, k: int) -> None:
        self.at(f"waiting for {s}RECV_B{k}")
        self.work.put_grads(s, k, self._wait(self._pending.pop(("B", s, k))))

    def send_f(self, s: int, k: int) -> None:
        outs = self.work.take_outputs(s, k)
        names = self.programs[s + 1].stage.inputs
        tags = [comms.p2p_tag(s, k, False, i, self._m) for i in range(len(names))]
        self._sends += comms.isend([outs[n] for n in names], self.mesh.global_rank(self.owner[s + 1]), tags)

    def send_b(self, s: int, k: int) -> None:
        gin = self.work.take_input_grads(s, k)
        names = self.programs[s - 1].diff_outputs
        tags = [comms.p2p_tag(s, k, True, i, self._m) for i in range(len(names))]
        self._sends += comms.isend([gin[n] for n in names], self.mesh.global_rank(self.owner[s - 1]), tags)

    def forward(self, s: int, k: int) -> None:
        self.at(f"running {s}F{k}")
        self.work.forward(s, k)
        if s + 1 == self.schedule.num_stages:
            self.work.take_outputs(s, k)
        elif self.owner[s + 1] == self.mesh.pp_rank:  # next stage on this rank: hand over in place
            self.work.put_inputs(s + 1, k, self.work.take_outputs(s, k))
        self.executed.append(f"{s}F{k}")

    def backward(self, s: int, k: int, kind: str) -> None:
        """kind "I" (input grads only) or "B" (input and weight grads)."""
        self.at(f"running {s}{kind}{k}")
        (self.work.input_grads if kind == "I" else self.work.full_backward)(s, k)
        if s == 0:
            self.work.take_input_grads(s, k)
        elif self.owner[s - 1] == self.mesh.pp_rank:
            self.work.put_grads(s - 1, k, self.work.take_input_grads(s, k))
        self.executed.append(f"{s}{kind}{k}")
        if kind == "B":
            self._stage_progress(s)

    def weight(self, s: int, k: int) -> None:
        self.at(f"running {s}W{k}")
        self.work.weight_grads(s, k)
        self.executed.append(f"{s}W{k}")
        self._stage_progress(s)

    def _wait(self, recv: comms.PendingRecv) -> dict[str, torch.Tensor]:
        t0 = time.monotonic()
        try:
            return recv.wait(self.timeout)
        except RuntimeError as e:
            waited = time.monotonic() - t0
            peer_pp = recv.peer % self.mesh.pp
            raise PeerTimeout(self._failure_report(
                f"got no {recv.what} from rank {recv.peer} (pp rank {peer_pp}) after {waited:.1f}s: that rank died "
                f"or is stuck ({str(e).splitlines()[0][:160]})")) from e

    def _failure_report(self, what: str) -> str:
        """This rank's failure, plus where every other rank said it was (through the c10d store)."""
        me = self.mesh.rank
        lines = [f"autopar rank {me} (pp {self.mesh.pp_rank}, dp {self.mesh.dp_rank}) at {self.position}: {what}"]
        store = comms.default_store()
        if store is not None:
            try:
                store.set(f"autopar/at/{me}", self.position)
                time.sleep(min(2.0, self.timeout.total_seconds() / 10))  # let the others report too
                world = self.mesh.pp * self.mesh.dp
                for r in range(world):
                    key = f"autopar/at/{r}"
                    where = store.get(key).decode() if store.check([key]) else "no report (dead, or stuck in compute)"
                    lines.append(f"  rank {r}: {where}")
            except Exception:  # noqa: BLE001 - the store may have died with rank 0
                lines.append("  (could not reach the store for the other ranks' positions)")
        return "\n".join(lines)

    # -- gradient and loss reduction --------------------------------------------------------------

    def _sync_grads(self) -> None:
        for fqn, group in self.mesh.tied_groups.items():
            p = self.params[fqn]
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            comms.all_reduce_sum(p.grad, group=group)
        if self.mesh.dp > 1 and self.grad_reduce != "zero1":
            if self.reducer is not None:
                self.reducer.finish(self.timeout)
            else:
                naive_all_reduce(self.params, self.my_params, self.mesh.dp_group)

    def _stage_progress(self, s: int) -> None:
        """Count a finished W/B of stage s; after the last one its gradients can be reduced."""
        self._wb_done[s] = self._wb_done.get(s, 0) + 1
        if self._wb_done[s] == self._m and self.reducer is not None:
            self.reducer.stage_done(s)

    def _broadcast_loss(self, local: torch.Tensor | None) -> torch.Tensor:
        last_rank = self.owner[-1]
        loss = local if local is not None else torch.zeros((), dtype=torch.float32, device=self.device)
        loss = loss.clone()
        if self.mesh.pp > 1:
            comms.broadcast(loss, src=self.mesh.global_rank(last_rank), group=self.mesh.pp_group)
        if self.mesh.dp > 1:
            comms.all_reduce_sum(loss, group=self.mesh.dp_group)
        return loss


def interpret(rt: DistributedPipeline, actions) -> None:
    """The oracle: walk the lowered action list, calling the primitives in order."""
    owner, me = rt.owner, rt.mesh.pp_rank
    for a in actions:
        s, k, t = a.stage, a.microbatch, a.type
        if t == "RECV_F":
            rt.recv_f(s, k)
        elif t == "RECV_B":
            rt.recv_b(s, k)
        elif t == "SEND_F":
            rt.send_f(s, k)
        elif t == "SEND_B":
            rt.send_b(s, k)
        elif t == "F":
            if s > 0 and owner[s - 1] != me:
                rt.wait_f(s, k)
            rt.forward(s, k)
        elif t in ("I", "B"):
            if s + 1 < len(owner) and owner[s + 1] != me:
                rt.wait_b(s, k)
            rt.backward(s, k, t)
        elif t == "W":
            rt.weight(s, k)
        else:
            raise ValueError(f"autopar: unknown action {a}")


def _input_specs(prog: StageProgram) -> dict[str, tuple]:
    phs = {n.name: n for n in prog.stage.gm.graph.nodes if n.op == "placeholder"}
    return {name: (tuple(phs[name].meta["val"].shape), phs[name].meta["val"].dtype) for name in prog.stage.inputs}


def _grad_specs(prog: StageProgram) -> dict[str, tuple]:
    out = next(n for n in prog.stage.gm.graph.nodes if n.op == "output")
    vals = {name: node.meta["val"] for name, node in zip(prog.stage.outputs, out.args[0])}
    return {name: (tuple(vals[name].shape), vals[name].dtype) for name in prog.diff_outputs if name != LOSS}
