"""Generate each rank's step as straight-line Python from its lowered action list.

One line per compute or communication action; a receive's wait is emitted right before the
first compute that reads it. The generated function calls the same primitives as
`runtime.distributed.interpret` (the oracle), so both give identical results; `pm.dump`
writes the source next to the stage code so a user can read what rank r does.
"""
from __future__ import annotations


def generate_source(actions, stage_to_rank, rank: int, name: str = "step") -> str:
    lines = [f"def {name}(rt):",
             f"    # pipeline rank {rank}: {sum(1 for a in actions if a.is_compute)} compute actions, "
             f"{sum(1 for a in actions if not a.is_compute)} communication actions"]
    num_stages = len(stage_to_rank)
    for a in actions:
        s, k, t = a.stage, a.microbatch, a.type
        if t == "RECV_F":
            lines.append(f"    rt.recv_f({s}, {k})  # post receive: activations for {s}F{k}")
        elif t == "RECV_B":
            lines.append(f"    rt.recv_b({s}, {k})  # post receive: gradients for {s}B{k}")
        elif t == "SEND_F":
            lines.append(f"    rt.send_f({s}, {k})  # to rank {stage_to_rank[s + 1]}")
        elif t == "SEND_B":
            lines.append(f"    rt.send_b({s}, {k})  # to rank {stage_to_rank[s - 1]}")
        elif t == "F":
            if s > 0 and stage_to_rank[s - 1] != rank:
                lines.append(f"    rt.wait_f({s}, {k})")
            lines.append(f"    rt.forward({s}, {k})")
        elif t in ("I", "B"):
            if s + 1 < num_stages and stage_to_rank[s + 1] != rank:
                lines.append(f"    rt.wait_b({s}, {k})")
            lines.append(f"    rt.backward({s}, {k}, {t!r})")
        elif t == "W":
            lines.append(f"    rt.weight({s}, {k})")
        else:
            raise ValueError(f"autopar: cannot generate code for action {a}")
    return "\n".join(lines) + "\n"


def compile_step(source: str, name: str = "step"):
    namespace: dict = {}
    exec(compile(source, f"<autopar generated {name}>", "exec"), namespace)  # noqa: S102 - our own generated code
    return namespace[name]
