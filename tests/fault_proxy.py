"""A loopback TCP proxy that injects network faults between a client and a server (S3, here moto).

    with FaultProxy(upstream_port) as proxy:   # clients connect to proxy.url
        proxy.set_mode("refuse")   # nothing listens: new connections get ECONNREFUSED, open ones a reset
        proxy.set_mode("hang")     # connections are accepted, bytes are neither forwarded nor answered
        proxy.set_mode("cut")      # every response is cut after its first bytes (a reset mid-body)
        proxy.set_mode("pass")     # a healthy network again

Plain threads: one accepting, two per connection copying bytes. Every socket and thread is closed and
joined on exit, whatever state the test left the proxy in. `faults` counts connections that met a
fault (refused connections are not seen, so they are not counted).
"""

from __future__ import annotations

import select
import socket
import struct
import threading
import time
from typing import Literal

Mode = Literal["pass", "refuse", "hang", "cut"]
_POLL_S = 0.05
_CUT_AFTER_BYTES = 64


class FaultProxy:
    def __init__(self, upstream_port: int, upstream_host: str = "127.0.0.1") -> None:
        self.upstream = (upstream_host, upstream_port)
        self.mode: Mode = "pass"
        self.faults = 0
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._sockets: set[socket.socket] = set()
        self._threads: list[threading.Thread] = []
        self._listener: socket.socket | None = None
        self.port = self._listen(0)
        self.url = f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def set_mode(self, mode: Mode) -> None:
        with self._lock:
            previous, self.mode = self.mode, mode
        if mode == "refuse":
            self._stop_listening()
            self._reset_all()  # open keep-alive connections die too, as with a crashed endpoint
        elif previous == "refuse":
            self._listen(self.port)

    def close(self) -> None:
        self._closed.set()
        self._stop_listening()
        self._reset_all()
        for thread in self._threads:
            thread.join(timeout=2)
        alive = [t.name for t in self._threads if t.is_alive()]
        assert not alive, f"fault proxy threads still running: {alive}"

    # internals

    def _listen(self, port: int) -> int:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", port))
        listener.listen(64)
        listener.settimeout(_POLL_S)
        self._listener = listener
        self._spawn(self._accept_loop, listener, name="fault-proxy-accept")
        return listener.getsockname()[1]

    def _stop_listening(self) -> None:
        listener, self._listener = self._listener, None
        if listener is not None:
            listener.close()

    def _accept_loop(self, listener: socket.socket) -> None:
        while not self._closed.is_set() and self._listener is listener:
            try:
                client, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:  # closed under us: refuse mode or teardown
                return
            client.settimeout(None)
            self._track(client)
            if self.mode == "hang":
                self.faults += 1
                continue  # held open, never answered, reset at teardown or on refuse
            try:
                upstream = socket.create_connection(self.upstream, timeout=2)
            except OSError:
                _reset(client)
                continue
            self._track(upstream)
            self._spawn(self._pump, client, upstream, False, name="fault-proxy-up")
            self._spawn(self._pump, upstream, client, True, name="fault-proxy-down")

    def _pump(self, source: socket.socket, sink: socket.socket, is_response: bool) -> None:
        sent = 0
        try:
            while not self._closed.is_set():
                if self.mode == "hang":
                    time.sleep(_POLL_S)  # the bytes wait in the kernel: the peer's read times out
                    continue
                readable, _, _ = select.select([source], [], [], _POLL_S)
                if not readable:
                    continue
                data = source.recv(65536)
                if not data:
                    sink.shutdown(socket.SHUT_WR)
                    return
                if is_response and self.mode == "cut" and sent + len(data) > _CUT_AFTER_BYTES:
                    sink.sendall(data[: max(0, _CUT_AFTER_BYTES - sent)])
                    self.faults += 1
                    _reset(sink)
                    _reset(source)
                    return
                sink.sendall(data)
                sent += len(data)
        except (OSError, ValueError):  # the other side or the teardown closed a socket
            return

    def _track(self, sock: socket.socket) -> None:
        with self._lock:
            self._sockets.add(sock)

    def _reset_all(self) -> None:
        with self._lock:
            sockets, self._sockets = self._sockets, set()
        for sock in sockets:
            _reset(sock)

    def _spawn(self, target, *args, name: str) -> None:
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        self._threads.append(thread)
        thread.start()


def _reset(sock: socket.socket) -> None:
    """Close with RST (SO_LINGER 0), as a crashed peer or a middlebox would."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    try:
        sock.close()
    except OSError:
        pass
