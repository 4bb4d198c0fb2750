"""`GET /v1/usage`: the calling tenant's use of this replica (tokens, queue time, fair share, limits)."""

from loraserve.usage.controller import UsageController

__all__ = ["UsageController"]
