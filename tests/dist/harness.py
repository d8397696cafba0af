"""Test helpers for the multi-process tests (the spawn runner is ``autopar.runtime.spawn``)."""


def reuse_captures() -> None:
    """In this (spawned) process, capture each zoo model once per plan-independent key
    (tests/models.memoized_capture). Not for passes that rewrite the capture in place (CP)."""
    import autopar.passes as passes
    from tests.models import memoized_capture

    if not getattr(passes.capture, "memoized", False):
        passes.capture = memoized_capture(passes.capture)
