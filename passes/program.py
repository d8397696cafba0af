"""What split_backward produces: programs as data (a GraphModule and the keys it reads and
writes, passes/keys.py). Running them is the runtime's job (runtime/execute.py)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch.fx as fx

from . import keys
from .split_stages import StageGraph


@dataclass
class Program:
    """One generated GraphModule and the env/state keys of its arguments and results (in order)."""

    gm: fx.GraphModule
    args: tuple[str, ...]
    results: tuple[str, ...]
    flops: int = 0
    # "stage 0 F" when the runtime runs it compiled by Inductor (Plan.compile, runtime/compiled.py);
    # then the seconds its first (compiling) call took, or why it runs op by op after all
    compiled_as: str | None = None
    compile_s: float | None = None
    compile_failure: str | None = None

    @property
    def code(self) -> str:
        return self.gm.code


@dataclass
class StageInfo:
    """What a process needs to know of a stage another pipeline rank runs."""

    stage: StageGraph
    diff_outputs: tuple[str, ...]


@dataclass
class StageProgram:
    """F/I/W/B programs of one stage.

    Result keys: F -> ``out:<name>`` activations, ``update:<fqn>`` buffer values, ``loss``, and
    ``saved:<node>`` values for I/W; I -> ``gin:<name>`` input grads and ``saved:<node>`` for W;
    W -> ``gparam:<fqn>``; B -> both gradient sets.
    """

    stage: StageGraph
    f: Program
    i: Program
    w: Program
    b: Program
    diff_outputs: tuple[str, ...]   # stage outputs that receive a gradient (LOSS for the last stage)
    grad_inputs: tuple[str, ...]    # stage inputs that get a gradient, in I's result order
    grad_params: tuple[str, ...]    # canonical FQNs that get a gradient
    input_strides: dict[str, tuple[int, ...]]  # layout each received activation must have
    saved_bytes: int                # bytes F keeps for I and W, per microbatch
    recompute: bool
    joint: fx.GraphModule = field(repr=False)
    # the backward makes element-wise values and casts again from what F keeps instead of F
    # keeping them (split_backward's ``remake``; never on a recomputing stage)
    remake: bool = False

    def __post_init__(self):
        # computed once: the runtime asks after every F and I of every microbatch
        self._keep = {
            "F": frozenset(k for k in self.i.args + self.w.args + self.b.args if not keys.is_state(k)),
            "I": frozenset(k for k in self.w.args if not keys.is_state(k)),
        }

    def keys_after(self, program: str) -> frozenset[str]:
        """Keys of a microbatch's env still needed after `program` ran (for releasing memory)."""
        return self._keep.get(program, frozenset())

    def with_programs(self, **programs: Program) -> "StageProgram":
        """A copy with some of f/i/w/b replaced (a graph rewrite such as ZeRO-3 streaming)."""
        parts = {k: programs.get(k, getattr(self, k)) for k in ("f", "i", "w", "b")}
        return StageProgram(stage=self.stage, **parts, diff_outputs=self.diff_outputs, grad_inputs=self.grad_inputs,
                            grad_params=self.grad_params, input_strides=self.input_strides,
                            saved_bytes=self.saved_bytes, recompute=self.recompute, joint=self.joint,
                            remake=self.remake)
