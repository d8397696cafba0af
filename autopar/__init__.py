"""autopar: graph-capture auto-parallelizer for PyTorch training.

    pm = autopar.parallelize(model, example_inputs, loss_fn=..., optimizer=..., plan=autopar.Plan(pp=2))
    loss = pm.step(inputs, target)
"""
from autopar.errors import CaptureError
from autopar.plan import Plan

__version__ = "0.1.0"
__all__ = ["parallelize", "Plan", "CaptureError", "ParallelModel", "MixedPrecision", "init_weights", "nn", "data",
           "Muon"]


def __getattr__(name):
    # torch is imported lazily so `autopar schedule ...` starts fast
    if name in ("parallelize", "ParallelModel"):
        from autopar import api

        return getattr(api, name)
    if name == "MixedPrecision":
        from autopar.precision import MixedPrecision

        return MixedPrecision
    if name == "Muon":
        from autopar.muon import Muon

        return Muon
    if name == "init_weights":  # the eager reproduction of parallelize's initialization
        from autopar.runtime.materialize import init_weights

        return init_weights
    if name in ("nn", "data"):  # autopar.nn.MoE, autopar.data.pack without a separate import
        import importlib

        return importlib.import_module(f"autopar.{name}")
    raise AttributeError(f"module 'autopar' has no attribute {name!r}")
