"""Starting and stopping an engine core process, and noticing its exit from any process.

`CoreHandle.start` makes a private folder for the core's two ipc:// addresses, spawns the core
(engine.core_process.process) and returns at once; front ends then connect to `handle.addresses`
(engine.frontend.core_client). The handle keeps a send-only control connection for messages that come
from whoever started the core rather than from a front end: PreloadAdapters at start, ClientGone when a
front-end process died, ShutdownCore at the end. `shutdown` always reaps the process: ShutdownCore, then
SIGTERM, then SIGKILL, each wait bounded.

`CoreWatch` tells a front end that the core exited: through the child's sentinel when the front end
started it, else through a pidfd (Linux 5.3+; without one, a poll of the pid), so front-end processes
that did not start the core notice its death as fast as the one that did.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import os
import select
import shutil
import signal
import tempfile
from dataclasses import dataclass
from pathlib import Path

import zmq

from engine.config import EngineConfig
from engine.core.steady import CpuPlan
from engine.core_process.process import CoreProcessOptions, run_engine_core
from engine.messages import CoreInput, ShutdownCore, encode

logger = logging.getLogger(__name__)

JOIN_S = 5.0  # each of: a clean exit after ShutdownCore, after SIGTERM, after SIGKILL
CONTROL_ID = b"control"


@dataclass(frozen=True)
class CoreAddresses:
    """Where a front end finds a running core (picklable: handed to front-end processes)."""

    inputs: str  # ipc:// ROUTER: requests in
    outputs: str  # ipc:// ROUTER: hello in, outputs out
    pid: int  # the core's process id, for CoreWatch.of_pid


class CoreWatch:
    """The core's liveness: `fd` becomes readable when it exits (None: poll `alive()`)."""

    def __init__(self, fd: int | None, alive, describe_exit, close=lambda: None) -> None:
        self.fd = fd
        self._alive = alive
        self._describe_exit = describe_exit
        self._close = close

    @classmethod
    def of_child(cls, process: multiprocessing.process.BaseProcess) -> CoreWatch:
        def describe() -> str:
            process.join(JOIN_S)
            return describe_exit(process.exitcode)

        return cls(process.sentinel, process.is_alive, describe)

    @classmethod
    def of_pid(cls, pid: int) -> CoreWatch:
        """A core another process started (its parent reaps it; its exit code is in that one's log)."""
        try:
            fd = os.pidfd_open(pid)
        except (AttributeError, OSError):  # no pidfd here (or the process is gone and reaped already)
            return cls(None, lambda: _pid_alive(pid), lambda: "exited")

        def alive() -> bool:
            readable, _, _ = select.select([fd], [], [], 0)
            return not readable

        return cls(fd, alive, lambda: "exited", lambda: os.close(fd))

    def alive(self) -> bool:
        return self._alive()

    def describe_exit(self) -> str:
        return self._describe_exit()

    def close(self) -> None:
        self._close()


class CoreHandle:
    """A started core process, owned by whoever started it."""

    def __init__(self, process, folder: str, addresses: CoreAddresses) -> None:
        self.process = process
        self.addresses = addresses
        self._folder = folder
        self._context = zmq.Context()
        self._control = self._context.socket(zmq.DEALER)
        self._control.setsockopt(zmq.ROUTING_ID, CONTROL_ID)
        self._control.setsockopt(zmq.LINGER, 0)
        self._control.setsockopt(zmq.SNDHWM, 0)
        self._control.connect(addresses.inputs)
        self._closed = False
        atexit.register(self.kill)  # before multiprocessing's own exit hook would join it forever

    @classmethod
    def start(
        cls,
        config: EngineConfig,
        *,
        adapter_source=None,
        lora_modules: tuple[tuple[str, str], ...] = (),
        triton_cache_dir: str | None = None,
        skip_tokenizer_init: bool = False,
        cpu_plan: CpuPlan | None = None,
    ) -> CoreHandle:
        """Spawn the core; returns at once (front ends connect and wait for CoreReady)."""
        folder = tempfile.mkdtemp(prefix="loraserve-core-")
        inputs, outputs = f"ipc://{folder}/inputs", f"ipc://{folder}/outputs"
        options = CoreProcessOptions(
            config=config,
            input_address=inputs,
            output_address=outputs,
            parent_pid=os.getpid(),
            adapter_source=adapter_source,
            lora_modules=tuple(lora_modules),
            triton_cache_dir=triton_cache_dir,
            skip_tokenizer_init=skip_tokenizer_init,
            log_level=logging.getLogger().getEffectiveLevel(),
            cpu_plan=cpu_plan,
        )
        # Not a daemon: the core starts adapter loader processes of its own, which daemons may not.
        process = multiprocessing.get_context("spawn").Process(
            target=run_engine_core, args=(options,), name="engine-core"
        )
        try:
            process.start()
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        return cls(process, folder, CoreAddresses(inputs, outputs, process.pid))

    @property
    def pid(self) -> int | None:
        return self.process.pid

    def watch(self) -> CoreWatch:
        return CoreWatch.of_child(self.process)

    def alive(self) -> bool:
        return self.process.is_alive()

    def send(self, *messages: CoreInput) -> bool:
        """Control messages, without blocking; False when the core is gone or the handle closed."""
        if self._closed or not self.process.is_alive():
            return False
        try:
            self._control.send_multipart([encode(m) for m in messages], zmq.NOBLOCK)
        except zmq.ZMQError:
            return False
        return True

    def shutdown(self, timeout_s: float = JOIN_S) -> None:
        """Stop the core (ShutdownCore, then SIGTERM, then SIGKILL, each wait bounded) and clean up."""
        if self._closed:
            return
        if self.process.is_alive():
            self.send(ShutdownCore())
            self.process.join(timeout_s)
            self.kill()
        self._closed = True
        self._control.close(linger=0)
        self._context.term()
        shutil.rmtree(self._folder, ignore_errors=True)
        atexit.unregister(self.kill)

    def kill(self) -> None:
        """SIGTERM, then SIGKILL, the core if it still runs (bounded joins)."""
        for stop in (self.process.terminate, self.process.kill):
            if self.process.pid is None or not self.process.is_alive():
                return
            stop()
            self.process.join(JOIN_S)


def describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _pid_alive(pid: int) -> bool:
    """True while `pid` runs (a zombie counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    return state != "Z"
