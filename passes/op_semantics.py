"""What aten ops mean to the graph passes: one table, read by context parallelism
(passes/context_parallel.py), tensor parallelism (passes/tensor_parallel.py) and Muon's
matrix routing (passes/optimizer_routing.py), so two passes never disagree on what an op is.

Each pass still decides what it does with an op (context parallelism finds attention by its
probabilities, tensor parallelism propagates a sharded dim through it); a family here says only
what the op computes. tests/unit/test_op_semantics.py lists the families both rewrites handle
and checks they read them from here.
"""
from __future__ import annotations

import torch

aten = torch.ops.aten

# a row-wise normalization into probabilities along one dim (attention probabilities, for
# context parallelism; a dim a tensor-parallel shard must not run along); ``_safe_softmax`` is
# what SDPA's math decomposition emits (a fully masked row gives zeros, not NaN)
SOFTMAX = frozenset({aten.softmax.int, aten._softmax.default, aten._safe_softmax.default})
# its log form (a cross-entropy's), row-wise along one dim the same way
LOG_SOFTMAX = frozenset({aten.log_softmax.int, aten._log_softmax.default})
# batched matrix products over the leading dims (attention's q @ k^T and p @ v)
MATMUL = frozenset({aten.matmul.default, aten.bmm.default})
# reshapes that keep the element order (a view where the layout allows, else a copy)
VIEWS = frozenset({aten.view.default, aten._unsafe_view.default, aten.reshape.default})
# ops whose value is their input's, copied, cast or aliased
SAME_VALUE = frozenset({aten.clone.default, aten._to_copy.default, aten.alias.default, aten.detach.default,
                        aten.contiguous.default, aten.lift_fresh_copy.default})
# the names (``OpOverloadPacket`` names, any namespace) of ops that multiply a weight matrix
# into activations: where Muon finds the hidden matrices it steps
GEMM_NAMES = frozenset({"linear", "mm", "addmm", "bmm", "baddbmm", "matmul", "_grouped_mm", "einsum"})
