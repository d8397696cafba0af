"""Executors for the per-stage F/I/W/B programs: local (one process, every rank in turn)."""
from .local import LocalPipeline

__all__ = ["LocalPipeline"]
