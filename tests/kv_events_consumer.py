"""A KV-event consumer written from vLLM's published schema alone, as a router would (no engine import).

It decodes with the `msgpack` package (not msgspec, not the engine's structs): a batch is
[ts, events, data_parallel_rank]; an event is a positional array tagged by its class name first, or a
map tagged by "type" (vLLM after #42892); BlockStored's fields are block_hashes, parent_block_hash,
token_ids, block_size, lora_id, medium, lora_name, in that order. A thread keeps a SUB socket polled (a
subscriber that does not poll never subscribes), and `fill_gaps` asks the replay ROUTER for missed
batches, so the state it rebuilds is complete.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import msgpack
import zmq

BLOCK_STORED_FIELDS = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
)
BLOCK_REMOVED_FIELDS = ("block_hashes", "medium")
END_SEQ = -1


@dataclass
class Event:
    kind: str  # BlockStored | BlockRemoved | AllBlocksCleared
    fields: dict = field(default_factory=dict)


def decode_batch(payload: bytes) -> tuple[float, list[Event], int | None]:
    batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    assert isinstance(batch, list) and len(batch) in (2, 3), batch
    ts, raw_events = batch[0], batch[1]
    rank = batch[2] if len(batch) == 3 else None
    return ts, [decode_event(e) for e in raw_events], rank


def decode_event(raw) -> Event:
    if isinstance(raw, dict):  # map encoding: the tag under "type"
        kind = raw["type"]
        return Event(kind, {k: v for k, v in raw.items() if k != "type"})
    kind, values = raw[0], raw[1:]
    names = {"BlockStored": BLOCK_STORED_FIELDS, "BlockRemoved": BLOCK_REMOVED_FIELDS}.get(kind, ())
    assert len(values) == len(names), (kind, values)
    return Event(kind, dict(zip(names, values)))


class Consumer:
    """Subscribes to a publisher, collects every batch by sequence number, rebuilds the cached hashes."""

    def __init__(
        self, endpoint: str, replay_endpoint: str | None = None, topic: bytes = b"", bind: bool = False
    ):
        self._context = zmq.Context()
        self._sub = self._context.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic)
        (self._sub.bind if bind else self._sub.connect)(endpoint)
        self.replay_endpoint = replay_endpoint
        self.batches: dict[int, bytes] = {}  # seq -> payload
        self.topics: set[bytes] = set()
        self.live: set[int] = set()  # seqs received on the PUB socket (the rest came from replays)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._sub.poll(20):
                topic, seq, payload = self._sub.recv_multipart()
                assert len(seq) == 8
                with self._lock:
                    number = int.from_bytes(seq, "big")
                    self.batches[number] = payload
                    self.live.add(number)
                    self.topics.add(topic)

    def settle(self, quiet_s: float = 0.4, timeout_s: float = 10.0) -> None:
        """Wait until no batch arrived for `quiet_s`."""
        deadline = time.monotonic() + timeout_s
        count, since = -1, time.monotonic()
        while time.monotonic() < deadline:
            with self._lock:
                now_count = len(self.batches)
            if now_count != count:
                count, since = now_count, time.monotonic()
            elif time.monotonic() - since >= quiet_s:
                return
            time.sleep(0.05)

    def replay(self, start: int, timeout_s: float = 10.0) -> list[tuple[int, bytes]]:
        """Ask the ROUTER endpoint for every buffered batch from `start` on, as vLLM's protocol defines."""
        socket = self._context.socket(zmq.DEALER)
        socket.connect(self.replay_endpoint)
        try:
            socket.send_multipart([b"", start.to_bytes(8, "big")])
            answers = []
            while True:
                assert socket.poll(int(timeout_s * 1000)), "the replay endpoint did not answer"
                empty, seq, payload = socket.recv_multipart()
                assert empty == b""
                number = int.from_bytes(seq, "big", signed=True)
                if number == END_SEQ:
                    assert payload == b""
                    return answers
                answers.append((number, payload))
        finally:
            socket.close(linger=0)

    def fill_gaps(self) -> list[int]:
        """Fetch missed batches (before the first received one, or between two) by replay; their seqs."""
        with self._lock:
            seen = sorted(self.batches)
        top = seen[-1] if seen else -1
        missing = [s for s in range(top + 1) if s not in self.batches]
        if missing:
            for number, payload in self.replay(missing[0]):
                with self._lock:
                    assert self.batches.setdefault(number, payload) == payload  # a replay repeats the stream
        return missing

    def events(self) -> list[Event]:
        """Every event in sequence order; the sequence must be gapless from 0."""
        with self._lock:
            numbers = sorted(self.batches)
            assert numbers == list(range(len(numbers))), f"gaps in the stream: {numbers}"
            return [event for n in numbers for event in decode_batch(self.batches[n])[1]]

    def cached_hashes(self) -> set[int]:
        """The prefix cache's hashes as the stream says: stored, not removed since, reset by a clear."""
        state: set[int] = set()
        for event in self.events():
            if event.kind == "BlockStored":
                state |= set(event.fields["block_hashes"])
            elif event.kind == "BlockRemoved":
                state -= set(event.fields["block_hashes"])
            elif event.kind == "AllBlocksCleared":
                state.clear()
            else:
                raise AssertionError(f"unknown event {event.kind}")
        return state

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self._sub.close(linger=0)
        self._context.term()
