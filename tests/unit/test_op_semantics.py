"""L3: one table of op semantics (passes/op_semantics.py). Context parallelism and tensor
parallelism read the families they both handle from it, so they agree op for op: softmax
(``_safe_softmax``, SDPA's math decomposition, included in both), batched matmuls and views;
Muon's routing finds GEMMs by the table's names."""
import torch

from autopar.passes import cp_rules as cp
from autopar.passes import op_semantics as ops
from autopar.passes import optimizer_routing
from autopar.passes import tp_rules as tp

aten = torch.ops.aten


def test_context_and_tensor_parallel_agree_on_the_ops_both_handle():
    both = {"softmax": (cp._SOFTMAX, tp._SOFTMAX & ops.SOFTMAX),
            "matmul": (cp._MATMUL, tp._MATMUL),
            "views": (cp._VIEWS, tp._VIEWS)}
    for family, (in_cp, in_tp) in both.items():
        assert in_cp == in_tp, (family, in_cp ^ in_tp)
    # the ops listed by hand: what each family holds
    assert cp._SOFTMAX == {aten.softmax.int, aten._softmax.default, aten._safe_softmax.default}
    assert tp._SOFTMAX - cp._SOFTMAX == {aten.log_softmax.int, aten._log_softmax.default}
    assert cp._MATMUL == {aten.matmul.default, aten.bmm.default}
    assert cp._VIEWS == {aten.view.default, aten._unsafe_view.default, aten.reshape.default}
    assert optimizer_routing._MATMUL is ops.GEMM_NAMES and {"mm", "addmm", "linear"} <= ops.GEMM_NAMES
