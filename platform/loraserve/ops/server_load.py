"""vLLM's server load: the completions and chat requests this replica is working on, for `GET /load`.

A request counts from the moment its engine requests are made until its answer or stream ends however it
ends (finished, client gone, failed), so a router can send new work to the replica with the fewest. Kept
only with `--enable-server-load-tracking`, as in vLLM.
"""

from __future__ import annotations

import msgspec


class LoadReport(msgspec.Struct, frozen=True, kw_only=True):
    server_load: int  # requests in flight on this replica, all tenants together


class ServerLoad:
    """A counter the event loop alone touches (no lock needed)."""

    def __init__(self) -> None:
        self.in_flight = 0

    def enter(self) -> None:
        self.in_flight += 1

    def leave(self) -> None:
        self.in_flight = max(0, self.in_flight - 1)

    def report(self) -> LoadReport:
        return LoadReport(server_load=self.in_flight)
