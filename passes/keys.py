"""The env key vocabulary: how stage programs name their arguments and results.

A program reads and writes *keys*. State keys name tensors shared by every microbatch and
live in one ``state`` dict (the live parameters, buffers and captured constants); every other
key lives in the env of one (stage, microbatch), which the runtime fills with what F returns
and empties as the later programs of that microbatch consume it.

=============  ==========================================================================
key            value
=============  ==========================================================================
param:<fqn>    a parameter (canonical FQN)                                      state
buffer:<fqn>   a buffer                                                         state
const:<name>   a constant the capture lifted out of the graph                   state
data:<name>    a model input or the target, sliced to the microbatch
in:<name>      an activation received from the previous stage
grad:<name>    the gradient flowing into stage output <name> (the loss's: the 1/n_total scale)
out:<name>     an activation F sends to the next stage
update:<fqn>   a buffer's new value (BatchNorm running stats), copied into the buffer after F
loss           the last stage's loss
saved:<node>   a value F keeps for I/W, or I keeps for W
gin:<name>     I's gradient of stage input <name> (sent to the previous stage)
gparam:<fqn>   W's (or B's) gradient of a parameter
=============  ==========================================================================

Every maker and parser of these strings is here; nothing else spells a prefix.
"""
from __future__ import annotations

PARAM, BUFFER, CONST = "param:", "buffer:", "const:"
DATA, INPUT, GRAD, OUT, UPDATE = "data:", "in:", "grad:", "out:", "update:"
SAVED, GIN, GPARAM = "saved:", "gin:", "gparam:"
LOSS = "loss"
STATE_KINDS = (PARAM, BUFFER, CONST)


def param(fqn: str) -> str:
    return PARAM + fqn


def buffer(fqn: str) -> str:
    return BUFFER + fqn


def const(name: str) -> str:
    return CONST + name


def data(name: str) -> str:
    return DATA + name


def input(name: str) -> str:  # noqa: A001 - the key kind's own name
    return INPUT + name


def grad(name: str) -> str:
    """Gradient flowing into the stage output ``name`` (the loss's is the 1/n_total scale)."""
    return GRAD + name


def out(name: str) -> str:
    return OUT + name


def update(fqn: str) -> str:
    return UPDATE + fqn


def saved(node_name: str) -> str:
    return SAVED + node_name


def gin(name: str) -> str:
    return GIN + name


def gparam(fqn: str) -> str:
    return GPARAM + fqn


def is_state(key: str) -> bool:
    """Parameters, buffers and constants: shared by every microbatch, not in a microbatch env."""
    return key.startswith(STATE_KINDS)


def is_kind(key: str, kind: str) -> bool:
    """``is_kind("saved:mm_3", keys.SAVED)``."""
    return key.startswith(kind)


def name_of(key: str, kind: str) -> str:
    """The FQN / name after the kind prefix: ``name_of("param:w", keys.PARAM) == "w"``."""
    assert key.startswith(kind), (key, kind)
    return key[len(kind):]


def state(params: dict, buffers: dict, constants: dict) -> dict:
    """The shared state dict programs read: ``param:``/``buffer:``/``const:`` keys -> tensors."""
    out_ = {param(f): p for f, p in params.items()}
    out_.update({buffer(f): b for f, b in buffers.items()})
    out_.update({const(n): c for n, c in constants.items()})
    return out_
