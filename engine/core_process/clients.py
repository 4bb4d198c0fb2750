"""The front ends an engine core serves ("clients"): their output routes, who owns which request, and
what each step sends each of them.

A client is a routing id (`fe-<slot>-<pid>`, any bytes) on the core's two ROUTER sockets. It joins with
a ClientHello on its output socket and gets CoreReady back. A request belongs to the client that added
it: its deltas go to that client only, and only that client may abort it. Each step, every client gets
one StepOutputs with its own deltas and the stats snapshot (encoded once for all of them); a client with
no deltas in a step gets the snapshot only when it changed and at most every STATS_INTERVAL_S, so many
idle front ends cost the loop nothing. Adapter events and adapter-source records go to the first client
still joined (the "lead"): the front ends' metrics add up across processes, so each event counts once.

A client that is gone is noticed either way: a send to it fails (the output ROUTER is set to report an
unroutable peer instead of dropping silently), or whoever watches its process sends ClientGone. Then its
requests are aborted (`on_gone`): nobody is left to read them.

        deltas of a step:  r1 (fe-0), r2 (fe-1), r3 (fe-0)      stats S (changed)
        fe-0 (lead):       StepOutputs([r1, r3], S, adapter events)
        fe-1:              StepOutputs([r2], S)
        fe-2 (idle):       StepOutputs([], S)   only if its last message is STATS_INTERVAL_S old
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import zmq

from engine.messages import RequestDelta, StepOutputs, encode, encode_stats
from engine.stats import EngineStats

logger = logging.getLogger(__name__)

# The longest a client without deltas waits for a changed stats snapshot.
STATS_INTERVAL_S = 0.05


@dataclass
class _Client:
    stats_version: int = -1  # the snapshot version it was last sent
    last_sent: float = 0.0


class Clients:
    def __init__(self, outputs: zmq.Socket, on_gone: Callable[[list[str]], None]) -> None:
        outputs.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a gone client raises instead of vanishing
        self._outputs = outputs
        self._on_gone = on_gone
        self._joined: dict[bytes, _Client] = {}  # in joining order: the first is the lead
        self._owner: dict[str, bytes] = {}  # request id -> its client
        self._stats: EngineStats | None = None
        self._stats_version = 0

    def __len__(self) -> int:
        return len(self._joined)

    @property
    def ids(self) -> list[bytes]:
        return list(self._joined)

    def join(self, client: bytes, ready: bytes) -> None:
        """A client said hello: answer with `ready` (an encoded CoreReady); it may add requests now."""
        if client not in self._joined:
            self._joined[client] = _Client()
            logger.info(
                "front end %s connected (%d in all)", client.decode(errors="replace"), len(self._joined)
            )
        self._send(client, ready)

    def own(self, request_id: str, client: bytes) -> bool:
        """Record that `client` added `request_id`; False (nothing recorded) when the id is taken."""
        if request_id in self._owner:
            return False
        self._owner[request_id] = client
        return True

    def owned_by(self, client: bytes, request_ids: Iterable[str]) -> list[str]:
        """The ids among `request_ids` that `client` added (a client may abort only its own)."""
        return [r for r in request_ids if self._owner.get(r) == client]

    def leave(self, client: bytes, why: str) -> None:
        """`client` is gone: forget it and abort its requests."""
        state = self._joined.pop(client, None)
        orphans = [r for r, owner in self._owner.items() if owner == client]
        for request_id in orphans:
            del self._owner[request_id]
        if state is not None or orphans:
            logger.warning(
                "front end %s is gone (%s): aborting its %d request(s)",
                client.decode(errors="replace"),
                why,
                len(orphans),
            )
        self._on_gone(orphans)

    def send_step(
        self,
        deltas: list[RequestDelta],
        stats: EngineStats,
        adapter_events: list,
        source_records: list,
        direct: Iterable[tuple[bytes, RequestDelta]] = (),
    ) -> None:
        """One step's messages (see the module docstring). `direct`: deltas for a given client whatever
        owns their id (refusals of an id another client already uses)."""
        mine: dict[bytes, list[RequestDelta]] = {}
        for client, delta in direct:
            if delta.finish_reason is not None and self._owner.get(delta.request_id) == client:
                del self._owner[delta.request_id]
            mine.setdefault(client, []).append(delta)
        for delta in deltas:
            client = self._owner.get(delta.request_id)
            if client is None:  # its client left
                continue
            if delta.finish_reason is not None:
                del self._owner[delta.request_id]
            mine.setdefault(client, []).append(delta)
        if stats != self._stats:
            self._stats, self._stats_version = stats, self._stats_version + 1
        now = time.monotonic()
        raw = None
        lead = next(iter(self._joined), None)
        for client, state in list(self._joined.items()):
            own = mine.get(client, [])
            events = (adapter_events, source_records) if client == lead else ([], [])
            stale = state.stats_version != self._stats_version and now - state.last_sent >= STATS_INTERVAL_S
            if not own and not events[0] and not events[1] and not stale:
                continue
            if raw is None:
                raw = encode_stats(stats)
            state.stats_version, state.last_sent = self._stats_version, now
            message = StepOutputs(deltas=own, stats=raw, adapter_events=events[0], source_records=events[1])
            self._send(client, encode(message))

    def _send(self, client: bytes, payload: bytes) -> None:
        try:
            self._outputs.send_multipart([client, payload], zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # EHOSTUNREACH: its socket closed (the process died or left)
            self.leave(client, f"unreachable: {exc.strerror}")
