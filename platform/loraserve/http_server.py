"""The API under uvicorn: the server that drains before it stops, and the sockets it listens on.

`loraserve serve` runs one app here (cli.py); with `--api-server-count` above 1 the supervisor binds the
sockets once and each front-end process runs its app on them (frontends/).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
from types import FrameType

import uvicorn

from loraserve.ops.http_timeouts import bounded_h11_protocol
from loraserve.ops.shutdown import Shutdown
from loraserve.settings import ServerSettings


class DrainingServer(uvicorn.Server):
    """uvicorn that drains before it stops: the first SIGTERM/SIGINT starts `Shutdown.drain`, a second stops now.

    The listening socket stays open while draining, so load balancers see 503s (and /ready 503)
    instead of refused connections while the replica empties.
    """

    def __init__(self, config: uvicorn.Config, shutdown: Shutdown) -> None:
        super().__init__(config)
        self._shutdown = shutdown
        self._drain_task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def startup(self, sockets: list | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)

    async def on_tick(self, counter: int) -> bool:
        if self._shutdown.fatal_error is not None:  # the engine core died: stop, so the pod restarts
            self.should_exit = True
        return await super().on_tick(counter)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._loop is None or self._drain_task is not None or self.should_exit:
            super().handle_exit(sig, frame)
            return
        logging.getLogger("loraserve").info("received %s: draining", signal.Signals(sig).name)
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        if self._drain_task is None:
            self._drain_task = asyncio.ensure_future(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        try:
            await self._shutdown.drain()
        finally:
            self.should_exit = True


def run_app(app, settings: ServerSettings, log_level: str, sockets: list[socket.socket] | None = None) -> int:
    """Serve `app` under uvicorn (on `sockets`, else on newly bound ones) until it stops; the exit code."""
    from loraserve.app import shutdown_of
    from loraserve.root_path import AcceptRootPathPrefix

    config = uvicorn.Config(
        AcceptRootPathPrefix(app, settings.root_path) if settings.root_path else app,
        host=settings.host,
        port=settings.port,
        root_path=settings.root_path,
        log_level=log_level,
        lifespan="on",
        timeout_graceful_shutdown=5,
        http=bounded_h11_protocol(
            settings.http_header_timeout, settings.http_body_timeout, settings.http_body_min_rate
        ),
    )
    shutdown = shutdown_of(app)
    DrainingServer(config, shutdown).run(sockets=sockets or listening_sockets(settings, config))
    if shutdown.fatal_error is not None:
        logging.getLogger("loraserve").error("exiting: %s", shutdown.fatal_error)
        return 1
    return 0


def listening_sockets(settings: ServerSettings, config: uvicorn.Config) -> list[socket.socket]:
    """The API's socket and, unless it is off, the metrics listener's: one server, one app, two ports.

    The app tells them apart by the port a request arrived on (loraserve.ops.metrics_access).
    """
    log = logging.getLogger("loraserve")
    sockets = [config.bind_socket()]
    port = settings.metrics_listen_port
    if port is not None:
        host = settings.metrics_host or settings.host
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            sock.close()
            if settings.metrics_port is not None:  # asked for explicitly: do not start without it
                raise SystemExit(f"--metrics-port {port}: cannot listen on {host}:{port} ({exc})") from None
            log.warning(
                "no metrics listener: %s:%d (--port + 1) is taken (%s); pass --metrics-port", host, port, exc
            )
        else:
            sock.set_inheritable(True)
            sockets.append(sock)
            log.info("metrics (/metrics, /health, /ready) on http://%s:%d", host, port)
    return sockets
