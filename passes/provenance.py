"""Where a graph node came from in the user's code (errors name the line that made a value)."""
from __future__ import annotations

import torch
import torch.fx as fx


def op_name(node: fx.Node) -> str:
    """The op's short name (``linear``, ``scaled_dot_product_attention``) or the function's."""
    t = node.target
    return t._schema.name.split("::")[-1] if isinstance(t, torch._ops.OpOverload) else getattr(t, "__name__", str(t))


def module_path(node: fx.Node) -> str:
    """The FQN of the innermost module that made ``node`` (as the user names it), or ''."""
    stack = node.meta.get("nn_module_stack")
    path = list(stack.values())[-1][0] if stack else ""
    return path.removeprefix("model.") if path != "model" else ""


def source_of(node: fx.Node) -> str:
    """The innermost frame of the user's code that made `node` ("file:line: code"), or ''."""
    trace = node.meta.get("stack_trace") or ""
    lines = trace.strip().splitlines()
    best = ""
    for i, line in enumerate(lines):
        line = line.strip()
        if line.startswith("File ") and "autopar/passes/capture.py" not in line:
            try:
                path = line.split('"')[1]
                lineno = line.split(", line ")[1].split(",")[0]
            except IndexError:
                continue
            code = lines[i + 1].strip() if i + 1 < len(lines) and not lines[i + 1].strip().startswith("File ") else ""
            best = f"{path}:{lineno}: `{code}`"
    return best
