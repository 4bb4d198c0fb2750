"""One front-end process of several: the whole app (HTTP, auth, tokenizing, streaming) on listening
sockets it shares with the others, joined to the engine core the supervisor started.

It runs in a process group of its own, so a Ctrl-C in a terminal reaches the supervisor alone, which
forwards SIGTERM to every front end (each drains, as the one server process does). It exits when the
supervisor is gone, and with code 1 when the engine core died (its streams end with an error first).
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass

from engine.core_process.handle import CoreAddresses
from loraserve.frontends.runtime import Runtime
from loraserve.settings import ServerSettings

log = logging.getLogger("loraserve")

PARENT_POLL_S = 0.5


@dataclass(frozen=True)
class FrontEndOptions:
    """What a front-end process is started with (pickled by multiprocessing's spawn; the sockets travel
    as duplicated descriptors)."""

    slot: int
    settings: ServerSettings
    sockets: tuple[socket.socket, ...]
    core: CoreAddresses
    runtime: Runtime
    supervisor_pid: int
    log_level: str


def run_front_end(options: FrontEndOptions) -> None:
    """The process's target."""
    os.setpgid(0, 0)
    logging.basicConfig(
        level=options.log_level.upper(),
        format=f"%(asctime)s %(levelname)s %(name)s [front-end {options.slot}]: %(message)s",
    )
    threading.Thread(
        target=_exit_when_orphaned, args=(options.supervisor_pid,), name="parent-watch", daemon=True
    ).start()
    from engine.core.steady import set_cpu_threads
    from loraserve.app import create_app
    from loraserve.frontends.role import FrontEnd
    from loraserve.http_server import run_app

    set_cpu_threads(cuda=True)  # a front end does no tensor math: one torch thread
    role = FrontEnd(options.slot, options.runtime, options.core)
    app = create_app(options.settings, role=role)
    code = run_app(app, options.settings, options.log_level, list(options.sockets))
    # The app's lifespan has closed everything: skip seconds of interpreter teardown (torch and all).
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _exit_when_orphaned(parent_pid: int) -> None:
    """A front end whose supervisor died is out of its care: exit (its connections close)."""
    while True:
        time.sleep(PARENT_POLL_S)
        if os.getppid() != parent_pid:
            log.error("the supervisor (pid %d) is gone: this front end exits", parent_pid)
            os._exit(1)
