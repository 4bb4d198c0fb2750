"""A front end's connection to the engine core: two sockets, and a thread that watches both them and
the core's process.

`CoreClient.connect(addresses, client_id, watch)` opens two DEALER sockets with the routing id
`client_id` (engine.core_process.clients): requests go out on one, and the other says ClientHello and then
receives this client's outputs. `wait_ready` waits, boundedly, for the core's CoreReady. From then on
one receiver thread reads StepOutputs and watches the core's process (engine.core_process.handle.CoreWatch):
the moment the core dies, `on_dead` is called once with an EngineDeadError naming why. The client never
stops the core: whoever started it does (engine.core_process.handle.CoreHandle).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import zmq

from engine.core_process.handle import CoreAddresses, CoreWatch
from engine.messages import ClientHello, CoreFailed, CoreInput, CoreReady, StepOutputs, decode_output, encode

logger = logging.getLogger(__name__)

# Loading a large model, capturing CUDA graphs and compiling kernels can take minutes on a fresh machine.
DEFAULT_STARTUP_TIMEOUT_S = 900.0
_POLL_MS = 100
_JOIN_S = 5.0


class EngineDeadError(RuntimeError):
    """The engine core stopped (crashed, was killed, or was shut down); no request can be served any more."""


class EngineStartupError(RuntimeError):
    """The engine core could not start (the message names why: bad model, too little memory, ...)."""


class CoreClient:
    def __init__(self, context: zmq.Context, inputs: zmq.Socket, outputs: zmq.Socket, watch: CoreWatch):
        self._context = context
        self._inputs = inputs
        self._outputs = outputs
        self.watch = watch
        self._send_lock = threading.Lock()  # zmq sockets are not thread-safe; senders are many
        self._closing = False
        self.dead_error: EngineDeadError | None = None
        self.ready: CoreReady | None = None
        self._on_outputs: Callable[[StepOutputs], None] = lambda outputs: None
        self._on_dead: Callable[[EngineDeadError], None] = lambda error: None
        self._receiver: threading.Thread | None = None

    @classmethod
    def connect(cls, addresses: CoreAddresses, client_id: str, watch: CoreWatch) -> CoreClient:
        """Connect to a core (started or still starting) and say hello; call `wait_ready` next."""
        context = zmq.Context()
        inputs = context.socket(zmq.DEALER)
        outputs = context.socket(zmq.DEALER)
        for socket in (inputs, outputs):
            socket.setsockopt(zmq.ROUTING_ID, client_id.encode())
            socket.setsockopt(zmq.LINGER, 0)
        inputs.setsockopt(zmq.SNDHWM, 0)  # never block a sender on a busy core; the core drains per step
        outputs.setsockopt(zmq.RCVHWM, 0)
        inputs.connect(addresses.inputs)
        outputs.connect(addresses.outputs)
        outputs.send(encode(ClientHello()))  # queued until the core has bound its socket
        return cls(context, inputs, outputs, watch)

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
                    raise EngineStartupError(f"the engine core could not start: {message.message}")
            elif not self.watch.alive():
                raise EngineStartupError(
                    f"the engine core exited during start-up ({self.watch.describe_exit()})"
                )
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
            if self._closing:
                raise self.dead_error or EngineDeadError("the engine was shut down")
            try:
                self._inputs.send_multipart(frames, zmq.NOBLOCK)
            except zmq.ZMQError as exc:  # the socket was closed meanwhile
                raise self.dead_error or EngineDeadError(f"the engine core is not reachable: {exc}") from None

    def close(self) -> None:
        """Stop the receiver and close the sockets (the core keeps running; its starter stops it)."""
        if self._closing:
            return
        with self._send_lock:
            self._closing = True
        if self._receiver is not None and self._receiver is not threading.current_thread():
            self._receiver.join(_JOIN_S)
        with self._send_lock:
            self._inputs.close(linger=0)
            self._outputs.close(linger=0)
        self._context.term()
        self.watch.close()
        if self.dead_error is None:
            self.dead_error = EngineDeadError("the engine was shut down")

    def _receive(self) -> None:
        poller = zmq.Poller()
        poller.register(self._outputs, zmq.POLLIN)
        if self.watch.fd is not None:
            poller.register(self.watch.fd, zmq.POLLIN)
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
            except zmq.ZMQError:  # closed by close()
                return
            except Exception:  # a bug in output handling must not stop the watch over the core
                logger.exception("handling the engine core's outputs failed")
            if (self.watch.fd is not None and self.watch.fd in events) or not self.watch.alive():
                if self._closing:
                    return
                reason = f"the engine core process exited unexpectedly ({self.watch.describe_exit()})"
                # The core's own words stay in the log: they may name paths or devices.
                self.dead_error = EngineDeadError(reason)
                logger.error("%s%s", reason, f"; its last error: {failure}" if failure else "")
                self._on_dead(self.dead_error)
                return
