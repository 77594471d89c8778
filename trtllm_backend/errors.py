"""Errors raised to callers of the engine. Each message names the offending field."""


class InvalidRequest(ValueError):
    """A request is malformed or cannot ever be served (raised before any memory is taken)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


class QueueFull(RuntimeError):
    """The waiting queue is at `max_queue_size`; the caller should answer UNAVAILABLE."""


class FragmentError(RuntimeError):
    """A fragment file is missing, corrupt (sha256 mismatch) or inconsistent with the manifest."""
