"""A loopback TCP proxy in front of moto that cuts connections mid-request, as a network failure would.

`CutProxy(upstream_port).cut(marker, after_bytes, times)`: the next `times` client connections that send
`marker` (e.g. the request line of one object's PUT) get `after_bytes` more bytes through to the server,
then both sides are closed. Everything else is relayed untouched. Threads only; `close()` ends them all.
"""

from __future__ import annotations

import socket
import threading


class CutProxy:
    def __init__(self, upstream_port: int) -> None:
        self.upstream = ("127.0.0.1", upstream_port)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.num_cuts = 0
        self._marker: bytes | None = None
        self._after_bytes = 0
        self._cuts_left = 0
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def cut(self, marker: bytes, after_bytes: int, times: int) -> None:
        with self._lock:
            self._marker, self._after_bytes, self._cuts_left = marker, after_bytes, times

    def close(self) -> None:
        self._closed = True
        self.listener.close()
        with self._lock:
            for sock in self._sockets:
                _close(sock)

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.upstream)
            with self._lock:
                self._sockets += [client, server]
            threading.Thread(target=self._client_to_server, args=(client, server), daemon=True).start()
            threading.Thread(target=_relay, args=(server, client), daemon=True).start()

    def _client_to_server(self, client: socket.socket, server: socket.socket) -> None:
        seen = b""  # the tail of what came before, so a marker split across reads is still found
        budget: int | None = None  # once the marker passed: bytes still relayed before the cut
        while data := _recv(client):
            if budget is None:
                with self._lock:
                    marker = self._marker if self._cuts_left > 0 else None
                    at = (seen + data).find(marker) if marker else -1
                    if at >= 0:
                        self._cuts_left -= 1
                        self.num_cuts += 1
                        marker_end = at + len(marker) - len(seen)  # in `data`
                        budget = self._after_bytes + marker_end
                seen = (seen + data)[-256:]
            if budget is not None and len(data) >= budget:
                _send(server, data[:budget])
                break
            if not _send(server, data):
                break
            if budget is not None:
                budget -= len(data)
        _close(server)
        _close(client)


def _recv(sock: socket.socket) -> bytes:
    try:
        return sock.recv(65536)
    except OSError:
        return b""


def _send(sock: socket.socket, data: bytes) -> bool:
    try:
        sock.sendall(data)
        return True
    except OSError:
        return False


def _relay(source: socket.socket, dest: socket.socket) -> None:
    while (data := _recv(source)) and _send(dest, data):
        pass
    _close(dest)


def _close(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()
