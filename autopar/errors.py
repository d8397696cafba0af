"""User-facing exceptions."""


class CaptureError(RuntimeError):
    """The model (with its loss) could not be captured as one static graph.

    The message names the user's source line that stopped the capture and what to do about it;
    the original exception is chained as ``__cause__``.
    """
