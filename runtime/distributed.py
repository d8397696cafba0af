"""Distributed mode: this process runs its pipeline rank's lowered action list.

Mesh (runtime/mesh.py): global rank = replica * pp + pp_rank (the ranks of one pipeline
replica are contiguous; a replica is one (dp, cp) pair). Activations and gradients move by
isend/irecv on one two-rank group per direction, matched in posting order as NCCL matches
them (tags 0; collectives/comms.py); a receive is posted where the lowered schedule puts its RECV and waited
on just before the compute that reads it;
a sent tensor is dropped as soon as the schedule proves its receiver has it (runtime/send_release.py:
at the first later message from that receiver), so what a rank holds of its sends is bounded
by its microbatches in flight, not by the step's microbatch count. After the last
action: tied parameters' gradients are summed over the pipeline ranks that hold them
(parallel/pipeline.py), then the data-parallel owner (parallel/data.py) finishes its
reduction over the dp*cp replicas (each microbatch loss was already scaled by 1/(dp*m*cp), so
the sum is the average: divided once).
"""
from __future__ import annotations

import time
from datetime import timedelta

import torch

from autopar.collectives import comms
from autopar.passes import keys
from autopar.passes.program import StageInfo, StageProgram
from autopar.schedules.ir import forward_only
from autopar.schedules.lower import lower
from autopar.schedules.nccl import check_nccl, prefetched

from . import boundary
from .actions import interpret
from .boundary import input_wires
from .codegen import compile_step, generate_source
from .execute import pauses
from .mesh import Mesh
from .send_release import release_points
from .stage_work import StageWork
from .streams import CommStream


class PeerTimeout(RuntimeError):
    pass


class DistributedPipeline:
    """Runs this rank's lowered actions; same results as LocalPipeline for the same schedule.

    ``data_parallel`` (parallel/data.DataParallel) reduces the gradients over the replicas and
    may have rewritten the programs (ZeRO-3); ``pipeline`` (parallel/pipeline.PipelineParallel)
    sums tied parameters over their pipeline holders. ``generated``: run the generated
    straight-line step (runtime/codegen.py) instead of interpreting the action list.
    """

    def __init__(self, programs: list[StageProgram | StageInfo], schedule, lowered, state: dict, mesh: Mesh,
                 timeout: timedelta, device: torch.device, *, data_parallel, pipeline, generated: bool = True,
                 comm: CommStream | None = None):
        self.schedule = schedule
        self.lowered = lowered
        self.mesh = mesh
        self.timeout = timeout
        self.device = device
        self.comm = comm if comm is not None else CommStream(device)  # CUDA: P2P and reductions on a side stream
        self.owner = schedule.stage_to_rank
        self.my_stages = [s for s in range(schedule.num_stages) if self.owner[s] == mesh.pp_rank]
        self.dp = data_parallel
        self.pipeline = pipeline
        self.programs = programs
        self.work = StageWork({s: programs[s] for s in self.my_stages}, schedule.num_stages, state,
                              data_parallel.grads, grad_sink=data_parallel.grad_sink)
        self.executed: list[str] = []
        self._compute_order = [(a.stage, a.microbatch, a.type) for a in lowered.actions[mesh.pp_rank] if a.is_compute]
        self.position = "not started"
        self.step_index = 0
        self._m = schedule.num_microbatches
        self.program = None  # generated step function (runtime/codegen.py); None = interpret
        self._eval_actions = None  # the lowered forward-only program of an evaluation, made on first use
        self._eval_release: dict = {}  # its release points (runtime/send_release.py)
        self.training = True
        self.units = self._units(lowered, data_parallel)
        if generated:
            self.program = compile_step(generate_source(lowered.actions[mesh.pp_rank], schedule.stage_to_rank,
                                                        mesh.pp_rank, overlap=self.units))
        # how activations cross ranks (runtime/boundary.py): as the receiving stage traced them
        self._in_wires = {s: input_wires(programs[s].stage) for s in self.my_stages}
        self._out_wires = {s: input_wires(programs[s + 1].stage) for s in self.my_stages
                           if s + 1 < schedule.num_stages and self.owner[s + 1] != mesh.pp_rank}
        self._grad_specs = {s: _grad_specs(programs[s]) for s in self.my_stages}
        # the shape and dtype every tensor this rank sends must have: what its receiver allocates
        self._act_out_specs = {s: {n: (w.shape, w.dtype) for n, w in ws.items()} for s, ws in self._out_wires.items()}
        self._grad_out_specs = {s: _grad_specs(programs[s - 1]) for s in self.my_stages
                                if s > 0 and self.owner[s - 1] != mesh.pp_rank}
        if mesh.pp > 1:
            self._check_boundaries()
        # wait key -> this rank's sends known complete once it was taken (training steps; an
        # evaluation has its own, from its forward-only program)
        self._release = release_points(lowered.actions, schedule.stage_to_rank, mesh.pp_rank)
        self.max_sends_held = 0  # most sends this rank held at once in the last step (tests, metrics)
        # gloo (CPU): receives from each peer, in the order the lowered program posts them. A
        # receive is posted at its place in the program or, earlier, as soon as the previous
        # receive from the same peer was consumed (the first at the start of the step): gloo's
        # receive is cheap while its message is still on the way, and costs 1-2 ms of
        # contention with gloo's I/O thread once the message sits in the socket. Each peer's
        # receives keep their order, on that peer's own channel (mesh.p2p_groups), so the
        # messages still match in posting order: schedules/nccl.prefetched replays exactly this
        # under NCCL's rules in the property tests, and it passes for every schedule. On CUDA
        # the lowered placement is kept as is (nothing measured to gain there yet).
        self._prefetch = comms.recv_prefetch(device.type)
        self._tagged = comms.p2p_tags_enabled()  # read once: the step loop builds tags per message
        # the programs obey NCCL's point-to-point rules on the channels used (one group per
        # direction), as lowered and as the receives are posted here: a named error otherwise
        issued = prefetched(lowered.actions, schedule.stage_to_rank) if self._prefetch else lowered.actions
        check_nccl(issued, schedule.stage_to_rank, schedule.num_stages, "direction", schedule.name)
        last: dict[int, tuple[str, int, int]] = {}  # peer -> its latest receive so far
        self._recv_first: list[tuple[str, int, int]] = []  # each peer's first receive of a step
        self._recv_next: dict[tuple[str, int, int], tuple[str, int, int]] = {}  # -> same peer's next
        for a in lowered.actions[mesh.pp_rank]:
            if a.type in ("RECV_F", "RECV_B"):
                key = ("F" if a.type == "RECV_F" else "B", a.stage, a.microbatch)
                peer = self.owner[a.stage - 1] if key[0] == "F" else self.owner[a.stage + 1]
                if peer in last:
                    self._recv_next[last[peer]] = key
                else:
                    self._recv_first.append(key)
                last[peer] = key

    def _check_boundaries(self) -> None:
        """Before any message: every pipeline rank of the replica tells the others what it will
        send across each boundary (its programs' traced results) and what it was built to
        receive (its receive buffers); any disagreement in names, order, shape or dtype is a
        ValueError on every rank, naming the boundary, the tensor, both sides and the source
        line that made it (instead of a receive that gloo aborts the process on)."""
        me = self.mesh.rank
        sends, expects = {}, {}
        for s in self.my_stages:
            prog = self.programs[s]
            if s in self._out_wires:
                sends["F", s] = boundary.sent_activations(prog, self._out_wires[s])
            if s > 0 and self.owner[s - 1] != self.mesh.pp_rank:
                names = tuple(self._grad_out_specs[s])
                sends["B", s] = boundary.sent_gradients(prog, names)
                peer = self.mesh.global_rank(self.owner[s - 1])
                expects["F", s - 1, peer] = boundary.expected({n: (w.shape, w.dtype)
                                                               for n, w in self._in_wires[s].items()})
            if s + 1 < self.schedule.num_stages and self.owner[s + 1] != self.mesh.pp_rank:
                peer = self.mesh.global_rank(self.owner[s + 1])
                expects["B", s + 1, peer] = boundary.expected(self._grad_specs[s])
        mine = (me, {k: v for k, v in sends.items() if v is not None}, expects)
        everyone = comms.all_gather_object(mine, group=self.mesh.pp_group)
        bad = boundary.mismatches({r: snd for r, snd, _e in everyone}, {r: exp for r, _s, exp in everyone})
        if bad:
            raise ValueError("autopar: the pipeline ranks disagree on what crosses a stage boundary (found before "
                             "any message was sent):\n  " + "\n  ".join(bad))

    # -- one step ----------------------------------------------------------------------------
    # The step is a sequence of calls to the primitives below, one (or two: a wait, then the
    # compute) per lowered action. `interpret` walks the action list; `generate` writes the same
    # calls out as straight-line Python (runtime/codegen.py). Both must give identical results.

    def run(self, microbatches: list[dict[str, torch.Tensor]], loss_scale: float, train: bool = True) -> torch.Tensor:
        """One step (``train=False``: an evaluation pass, the forwards only, stage by stage, with
        no gradient, no reduction and no buffer update); returns the loss."""
        self.work.begin(microbatches, loss_scale)
        self.training = train
        self._wb_done: dict[int, int] = {}
        if train:
            self.dp.begin_step()
        self._pending: dict[tuple[str, int, int], comms.PendingRecv] = {}
        self._posted: set[tuple[str, int, int]] = set()  # this step's receives, consumed or not
        self._sends: dict[tuple[str, int, int], list] = {}  # send key -> its (work, tensor) pairs
        self.max_sends_held = 0
        self.executed = []
        try:
            if self._prefetch and train:
                for key in self._recv_first:
                    self._post(key)
            if not train:
                if self._eval_actions is None:
                    evl = lower(forward_only(self.schedule))
                    self._eval_actions = evl.actions[self.mesh.pp_rank]
                    self._eval_release = release_points(evl.actions, self.owner, self.mesh.pp_rank)
                interpret(self, self._eval_actions, self.owner, self.mesh.pp_rank)
            elif self.program is not None:
                self.program(self)
            else:
                interpret(self, self.lowered.actions[self.mesh.pp_rank], self.owner, self.mesh.pp_rank, self.units)
            assert not self._pending, f"receives never consumed: {sorted(self._pending)}"
            self.at("waiting for sends to finish")
            for key in list(self._sends):
                self._release_send(key)
            if train:
                self.at("gradient reduction")
                self._sync_grads()
            loss = self._broadcast_loss(self.work.total_loss())
        except (RuntimeError, ValueError) as e:
            if isinstance(e, PeerTimeout):
                raise
            why = f"failed with {type(e).__name__}: {str(e).splitlines()[0][:300]}"
            raise PeerTimeout(self._failure_report(why)) from e
        self.at("done")
        self.step_index += 1
        return loss

    def _units(self, lowered, data_parallel) -> frozenset[int]:
        """Positions of this rank's F&B units that run interleaved (``forward_backward``): those
        of a DualPipeV schedule whose programs leave all-to-alls in flight (MoE dispatch
        chains), except under ZeRO-3, whose two parameter gather buffers serve one program at
        a time (the unit's halves then run one after the other, as every other schedule's)."""
        if not lowered.overlap or getattr(data_parallel, "zero", 0) == 3:
            return frozenset()
        if not pauses([self.programs[s] for s in self.my_stages]):
            return frozenset()
        return frozenset(lowered.overlap[self.mesh.pp_rank])

    def at(self, what: str) -> None:
        self.position = f"step {self.step_index}, {what}"

    def recv_f(self, s: int, k: int) -> None:
        """Post the receive of stage s's input activations for microbatch k (if not yet posted)."""
        if ("F", s, k) not in self._posted:
            self._post(("F", s, k))

    def recv_b(self, s: int, k: int) -> None:
        """Post the receive of the gradients of stage s's outputs for microbatch k (if not yet posted)."""
        if ("B", s, k) not in self._posted:
            self._post(("B", s, k))

    def _post(self, key: tuple[str, int, int]) -> None:
        self._posted.add(key)
        (self._post_f if key[0] == "F" else self._post_b)(key[1], key[2])

    def _post_f(self, s: int, k: int) -> None:
        peer = self.mesh.global_rank(self.owner[s - 1])
        bufs = {n: torch.empty(w.shape, dtype=w.dtype, device=self.device) for n, w in self._in_wires[s].items()}
        tags = self._tags(s - 1, k, False, len(bufs))
        with self.comm.launch():
            self._pending["F", s, k] = comms.irecv(bufs, peer, tags, self._channel(s - 1, s),
                                                   what=f"activations from {s - 1}F{k}")

    def _post_b(self, s: int, k: int) -> None:
        peer = self.mesh.global_rank(self.owner[s + 1])
        bufs = {n: torch.empty(shape, dtype=dt, device=self.device) for n, (shape, dt) in self._grad_specs[s].items()}
        tags = self._tags(s + 1, k, True, len(bufs))
        with self.comm.launch():
            self._pending["B", s, k] = comms.irecv(bufs, peer, tags, self._channel(s + 1, s),
                                                   what=f"gradients from {s + 1}I{k}")

    def wait_f(self, s: int, k: int) -> None:
        self.at(f"waiting for {s}RECV_F{k}")
        got = self._wait(self._consume(("F", s, k)))
        self.work.put_inputs(s, k, {n: self._in_wires[s][n].unpack(t) for n, t in got.items()})
        self._taken(("F", s, k))

    def wait_b(self, s: int, k: int) -> None:
        self.at(f"waiting for {s}RECV_B{k}")
        self.work.put_grads(s, k, self._wait(self._consume(("B", s, k))))
        self._taken(("B", s, k))

    def _consume(self, key: tuple[str, int, int]) -> comms.PendingRecv:
        """The posted receive `key`, after posting the next receive from the same peer."""
        nxt = self._recv_next.get(key) if self._prefetch and self.training else None
        if nxt is not None and nxt not in self._posted:  # (receives may be consumed out of order)
            self._post(nxt)
        return self._pending.pop(key)

    def _taken(self, key: tuple[str, int, int]) -> None:
        """A message was taken: drop the sends that the peer is now known to have received."""
        for sent in (self._release if self.training else self._eval_release).get(key, ()):
            self._release_send(sent)

    def _hold_send(self, key: tuple[str, int, int], works: list) -> None:
        self._sends[key] = works
        self.max_sends_held = max(self.max_sends_held, len(self._sends))

    def _release_send(self, key: tuple[str, int, int]) -> None:
        for w, _t in self._sends.pop(key, ()):
            w.wait(self.timeout)

    def send_f(self, s: int, k: int) -> None:
        outs = self.work.take_outputs(s, k)
        wires = self._out_wires[s]
        tags = self._tags(s, k, False, len(wires))
        packed = [w.pack(outs[n]) for n, w in wires.items()]
        self._check_sent(s, s + 1, "activations", packed, self._act_out_specs[s])
        with self.comm.launch():
            self._hold_send(("F", s, k), comms.isend(packed, self.mesh.global_rank(self.owner[s + 1]), tags,
                                                     self._channel(s, s + 1)))

    def send_b(self, s: int, k: int) -> None:
        gin = self.work.take_input_grads(s, k)
        specs = self._grad_out_specs[s]
        tags = self._tags(s, k, True, len(specs))
        grads = [gin[n] for n in specs]
        self._check_sent(s, s - 1, "input gradients", grads, specs)
        with self.comm.launch():
            self._hold_send(("B", s, k), comms.isend(grads, self.mesh.global_rank(self.owner[s - 1]), tags,
                                                     self._channel(s, s - 1)))

    def _tags(self, send_stage: int, k: int, backward: bool, n: int) -> list[int]:
        """The tags of a message's ``n`` tensors: 0 (matched by order, as NCCL does), or with
        ``AUTOPAR_P2P_TAGS=1`` each its own (collectives/comms.py)."""
        if not self._tagged:
            return [0] * n
        return [comms.p2p_tag(send_stage, k, backward, i, self._m) for i in range(n)]

    def _channel(self, from_stage: int, to_stage: int):
        """The group carrying messages from ``from_stage``'s rank to ``to_stage``'s (mesh.p2p_groups)."""
        return self.mesh.p2p_groups[self.owner[from_stage], self.owner[to_stage]]

    def _check_sent(self, s: int, to: int, what: str, tensors: list, specs: dict) -> None:
        """A message must be what its receiver allocated: a runtime value that differs from
        its traced one is a ValueError here, on the sender, never a receive gloo aborts on."""
        for t, (name, (shape, dtype)) in zip(tensors, specs.items()):
            if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
                raise ValueError(f"autopar: pipeline boundary stage {s} -> stage {to} ({what}): tensor {name!r} is "
                                 f"{list(t.shape)} {t.dtype} at run time, but the receiver was built for "
                                 f"{list(shape)} {dtype} (the traced value); the stage's program computes another "
                                 "shape than it was traced with: report it with the model")

    def forward(self, s: int, k: int) -> None:
        self.at(f"running {s}F{k}")
        self.work.forward(s, k, train=self.training)
        self._forwarded(s, k)

    def forward_backward(self, sf: int, kf: int, sb: int, kb: int, kind: str) -> None:
        """An F&B unit: the two programs interleaved (runtime/stage_work.py), then each half's hand-over."""
        self.at(f"running {sf}F{kf} with {sb}{kind}{kb}")
        self.work.forward_backward(sf, kf, sb, kb, kind)
        self._forwarded(sf, kf)
        self._backwarded(sb, kb, kind)

    def _forwarded(self, s: int, k: int) -> None:
        if s + 1 == self.schedule.num_stages:
            self.work.take_outputs(s, k)
        elif self.owner[s + 1] == self.mesh.pp_rank:  # next stage on this rank: hand over in place
            self.work.put_inputs(s + 1, k, self.work.take_outputs(s, k))
        self.executed.append(f"{s}F{k}")
        self._prefetch_next()

    def _prefetch_next(self) -> None:
        """Start bringing back what the rank's next compute action reads, if the activation
        offload parked it (runtime/offload.py): its copy runs while this rank waits or computes."""
        offload = self.work.offload
        if offload is None or not self.training or not offload.prefetch_ahead:
            return
        order = self._compute_order
        if len(self.executed) < len(order):
            s, k, kind = order[len(self.executed)]
            if kind != "F":
                offload.prefetch(s, k, kind)

    def backward(self, s: int, k: int, kind: str) -> None:
        """kind "I" (input grads only) or "B" (input and weight grads)."""
        self.at(f"running {s}{kind}{k}")
        (self.work.input_grads if kind == "I" else self.work.full_backward)(s, k)
        self._backwarded(s, k, kind)

    def _backwarded(self, s: int, k: int, kind: str) -> None:
        if s == 0:
            self.work.take_input_grads(s, k)
        elif self.owner[s - 1] == self.mesh.pp_rank:
            self.work.put_grads(s - 1, k, self.work.take_input_grads(s, k))
        self.executed.append(f"{s}{kind}{k}")
        self._prefetch_next()
        if kind == "B":
            self._stage_progress(s)

    def weight(self, s: int, k: int) -> None:
        self.at(f"running {s}W{k}")
        self.work.weight_grads(s, k)
        self.executed.append(f"{s}W{k}")
        self._prefetch_next()
        self._stage_progress(s)

    def _wait(self, recv: comms.PendingRecv) -> dict[str, torch.Tensor]:
        t0 = time.monotonic()
        try:
            return recv.wait(self.timeout)
        except RuntimeError as e:
            waited = time.monotonic() - t0
            peer_pp = recv.peer // self.mesh.tp % self.mesh.pp
            raise PeerTimeout(self._failure_report(
                f"got no {recv.what} from rank {recv.peer} (pp rank {peer_pp}) after {waited:.1f}s: that rank died "
                f"or is stuck ({str(e).splitlines()[0][:160]})")) from e

    def _failure_report(self, what: str) -> str:
        """This rank's failure, plus where every other rank said it was (through the c10d store)."""
        me = self.mesh.rank
        lines = [f"autopar rank {me} ({self.mesh.describe()}) at {self.position}: {what}"]
        store = comms.default_store()
        if store is not None:
            try:
                store.set(f"autopar/at/{me}", self.position)
                time.sleep(min(2.0, self.timeout.total_seconds() / 10))  # let the others report too
                for r in range(self.mesh.world):
                    key = f"autopar/at/{r}"
                    where = store.get(key).decode() if store.check([key]) else "no report (dead, or stuck in compute)"
                    lines.append(f"  rank {r}: {where}")
            except Exception:  # noqa: BLE001 - the store may have died with rank 0
                lines.append("  (could not reach the store for the other ranks' positions)")
        return "\n".join(lines)

    # -- gradient and loss reduction --------------------------------------------------------------

    def _sync_grads(self) -> None:
        self.pipeline.sum_tied_gradients(self.dp.grads, skip=self.dp.sums_tied)
        self.dp.finish()

    def _stage_progress(self, s: int) -> None:
        """Count a finished W/B of stage s; after the last one its gradients can be reduced."""
        self._wb_done[s] = self._wb_done.get(s, 0) + 1
        if self._wb_done[s] == self._m:
            self.dp.stage_done(s)

    def _broadcast_loss(self, local: torch.Tensor | None) -> torch.Tensor:
        last_rank = self.owner[-1]
        loss = local if local is not None else torch.zeros((), dtype=torch.float32, device=self.device)
        loss = loss.clone()
        if self.mesh.pp > 1:
            comms.broadcast(loss, src=self.mesh.global_rank(last_rank), group=self.mesh.pp_group)
        if self.mesh.replicas > 1:
            comms.all_reduce_sum(loss, group=self.mesh.replica_group)
        return loss


def _grad_specs(prog: StageProgram) -> dict[str, tuple]:
    out = next(n for n in prog.stage.gm.graph.nodes if n.op == "output")
    vals = {name: node.meta["val"] for name, node in zip(prog.stage.outputs, out.args[0])}
    return {name: (tuple(vals[name].shape), vals[name].dtype) for name in prog.diff_outputs if name != keys.LOSS}
