"""The front end's end of the engine core: the process, its two sockets, and a thread that watches both.

`CoreClient.start` binds an input (PUSH) and an output (PULL) socket on ipc:// paths in a private
temporary folder, spawns the core process (engine.core.process) and waits, boundedly, for its
CoreReady. From then on one receiver thread reads StepOutputs and watches the process sentinel: the
moment the core dies, `on_dead` is called once with an EngineDeadError naming the exit code and, if
the core said, the cause. Every wait here is bounded; `shutdown` always reaps the process.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable

import zmq

from engine.config import EngineConfig
from engine.core.process import CoreProcessOptions, run_engine_core
from engine.messages import CoreFailed, CoreInput, CoreReady, ShutdownCore, StepOutputs, decode_output, encode

logger = logging.getLogger(__name__)

# Loading a large model, capturing CUDA graphs and compiling kernels can take minutes on a fresh machine.
DEFAULT_STARTUP_TIMEOUT_S = 900.0
_POLL_MS = 100
_JOIN_S = 5.0  # each of: a clean exit after ShutdownCore, after SIGTERM, after SIGKILL


class EngineDeadError(RuntimeError):
    """The engine core stopped (crashed, was killed, or was shut down); no request can be served any more."""


class EngineStartupError(RuntimeError):
    """The engine core could not start (the message names why: bad model, too little memory, ...)."""


class CoreClient:
    def __init__(self, process, context: zmq.Context, inputs: zmq.Socket, outputs: zmq.Socket, folder: str):
        self.process = process
        self._context = context
        self._inputs = inputs
        self._outputs = outputs
        self._folder = folder
        self._send_lock = threading.Lock()  # zmq sockets are not thread-safe; senders are many
        self._closing = False
        self.dead_error: EngineDeadError | None = None
        self.ready: CoreReady | None = None
        self._on_outputs: Callable[[StepOutputs], None] = lambda outputs: None
        self._on_dead: Callable[[EngineDeadError], None] = lambda error: None
        self._receiver: threading.Thread | None = None
        atexit.register(self._kill)  # before multiprocessing's own exit hook would join it forever

    @classmethod
    def start(
        cls,
        config: EngineConfig,
        *,
        adapter_source=None,
        lora_modules: tuple[tuple[str, str], ...] = (),
        triton_cache_dir: str | None = None,
        skip_tokenizer_init: bool = False,
    ) -> CoreClient:
        """Bind the sockets and spawn the core; returns at once (call `wait_ready` next)."""
        folder = tempfile.mkdtemp(prefix="loraserve-core-")
        context = zmq.Context()
        inputs = context.socket(zmq.PUSH)
        outputs = context.socket(zmq.PULL)
        inputs.setsockopt(zmq.SNDHWM, 0)  # never block a sender on a busy core; the core drains per step
        inputs.setsockopt(zmq.LINGER, 0)
        outputs.setsockopt(zmq.RCVHWM, 0)
        inputs.bind(f"ipc://{folder}/inputs")
        outputs.bind(f"ipc://{folder}/outputs")
        options = CoreProcessOptions(
            config=config,
            input_address=f"ipc://{folder}/inputs",
            output_address=f"ipc://{folder}/outputs",
            parent_pid=os.getpid(),
            adapter_source=adapter_source,
            lora_modules=tuple(lora_modules),
            triton_cache_dir=triton_cache_dir,
            skip_tokenizer_init=skip_tokenizer_init,
            log_level=logging.getLogger().getEffectiveLevel(),
        )
        # Not a daemon: the core starts adapter loader processes of its own, which daemons may not.
        process = multiprocessing.get_context("spawn").Process(
            target=run_engine_core, args=(options,), name="engine-core"
        )
        client = cls(process, context, inputs, outputs, folder)
        try:
            process.start()
        except BaseException:
            client.shutdown()
            raise
        return client

    def wait_ready(self, timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S) -> CoreReady:
        """Block until the core said CoreReady; EngineStartupError if it failed, died or took too long."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._outputs.poll(_POLL_MS):
                message = decode_output(self._outputs.recv())
                if isinstance(message, CoreReady):
                    self.ready = message
                    return message
                if isinstance(message, CoreFailed):
                    self.shutdown()
                    raise EngineStartupError(f"the engine core could not start: {message.message}")
            elif not self.process.is_alive():
                code = self.process.exitcode
                self.shutdown()
                raise EngineStartupError(f"the engine core exited during start-up ({_describe_exit(code)})")
        self.shutdown()
        raise EngineStartupError(f"the engine core was not ready within {timeout_s:.0f} s")

    def run(
        self, on_outputs: Callable[[StepOutputs], None], on_dead: Callable[[EngineDeadError], None]
    ) -> None:
        """Start the receiver thread: `on_outputs` per message, `on_dead` once if the core dies (that thread)."""
        self._on_outputs, self._on_dead = on_outputs, on_dead
        self._receiver = threading.Thread(target=self._receive, name="engine-core-outputs", daemon=True)
        self._receiver.start()

    def send(self, *messages: CoreInput) -> None:
        """Hand messages to the core without blocking; EngineDeadError once the core is gone. The messages
        of one call arrive together (one multipart message), so the core handles them in the same step:
        the children of an n > 1 request start together, as one request would."""
        if self.dead_error is not None:
            raise self.dead_error
        frames = [encode(message) for message in messages]
        with self._send_lock:
            try:
                self._inputs.send_multipart(frames, zmq.NOBLOCK)
            except zmq.ZMQError as exc:  # EAGAIN: no core connected any more; or the socket was closed
                raise self.dead_error or EngineDeadError(f"the engine core is not reachable: {exc}") from None

    def shutdown(self, timeout_s: float = _JOIN_S) -> None:
        """Stop the core (ShutdownCore, then SIGTERM, then SIGKILL, each wait bounded) and clean up."""
        if self._closing:
            return
        self._closing = True
        if self.process.pid is not None and self.process.is_alive():
            with self._send_lock:
                try:
                    self._inputs.send(encode(ShutdownCore()), zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass
            self.process.join(timeout_s)
            self._kill()
        if self._receiver is not None:
            self._receiver.join(timeout_s)
        with self._send_lock:
            self._inputs.close(linger=0)
            self._outputs.close(linger=0)
        self._context.term()
        shutil.rmtree(self._folder, ignore_errors=True)
        atexit.unregister(self._kill)
        if self.dead_error is None:
            self.dead_error = EngineDeadError("the engine was shut down")

    def _kill(self) -> None:
        """SIGTERM, then SIGKILL, the core if it still runs (bounded joins)."""
        for stop in (self.process.terminate, self.process.kill):
            if self.process.pid is None or not self.process.is_alive():
                return
            stop()
            self.process.join(_JOIN_S)

    def _receive(self) -> None:
        poller = zmq.Poller()
        poller.register(self._outputs, zmq.POLLIN)
        poller.register(self.process.sentinel, zmq.POLLIN)
        failure: str | None = None
        while not self._closing:
            events = dict(poller.poll(_POLL_MS))
            try:
                while self._outputs.poll(0):
                    message = decode_output(self._outputs.recv())
                    if isinstance(message, StepOutputs):
                        self._on_outputs(message)
                    elif isinstance(message, CoreFailed):
                        failure = message.message
            except zmq.ZMQError:  # closed by shutdown
                return
            except Exception:  # a bug in output handling must not stop the watch over the core
                logger.exception("handling the engine core's outputs failed")
            if self.process.sentinel in events or not self.process.is_alive():
                if self._closing:
                    return
                self.process.join(_JOIN_S)
                reason = (
                    f"the engine core process exited unexpectedly ({_describe_exit(self.process.exitcode)})"
                )
                # The core's own words stay in the log: they may name paths or devices.
                self.dead_error = EngineDeadError(reason)
                logger.error("%s%s", reason, f"; its last error: {failure}" if failure else "")
                self._on_dead(self.dead_error)
                return


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"
