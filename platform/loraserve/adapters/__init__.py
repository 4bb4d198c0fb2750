"""The adapter API: `POST/GET/DELETE /v1/adapters` over the tenant's part of the adapter store."""

from loraserve.adapters.controller import AdaptersController, adapters_controller, upload_limit_bytes

__all__ = ["AdaptersController", "adapters_controller", "upload_limit_bytes"]
