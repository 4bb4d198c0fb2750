"""`--root-path /llm` as vLLM serves it: both `/v1/...` (a proxy stripped the prefix) and `/llm/v1/...` (a
client that sent the prefix straight to the server) reach the same handlers.

uvicorn writes the root path in front of every request's `path` (the ASGI rule), and Litestar routes what
follows it; a request that carried the prefix itself then arrives as `/llm/llm/v1/...`. This wrapper drops
the doubled prefix before Litestar sees the request, so it routes, and its error messages name the path
the client sent.
"""

from __future__ import annotations

from typing import Any


class AcceptRootPathPrefix:
    def __init__(self, app: Any, root_path: str) -> None:
        self.app = app
        self.root_path = root_path
        self._doubled = root_path + root_path

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        path = scope.get("path", "")
        if scope["type"] in ("http", "websocket") and (
            path == self._doubled or path.startswith(self._doubled + "/")
        ):
            scope = {**scope, "path": path[len(self.root_path) :]}
            raw = scope.get("raw_path")
            if raw is not None and raw.startswith(self._doubled.encode()):
                scope["raw_path"] = raw[len(self.root_path) :]
        await self.app(scope, receive, send)
