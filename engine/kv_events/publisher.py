"""Publishes KV event batches on a ZeroMQ PUB socket, and replays missed ones on a ROUTER socket.

The engine thread hands each step's batch to `publish`, which only queues it: a thread of its own owns
both sockets, numbers the batches (0, 1, 2, ...), sends each as [topic, seq, payload] (seq: 8 bytes,
big-endian) and keeps the last `buffer_steps` payloads for replay. Serving never waits on a subscriber:
the PUB socket drops what exceeds its high-water mark, and a full queue drops the batch with a warning.

Replay (vLLM's protocol): a client sends [b"", start] to the ROUTER endpoint (a DEALER socket, or REQ
which adds the empty frame itself), `start` the first sequence number it missed as 8 bytes big-endian;
it gets [b"", seq, payload] for every buffered batch numbered `start` or later, oldest first, and then
[b"", END_SEQ, b""], END_SEQ being -1 as 8 signed big-endian bytes.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import deque

import msgspec
import zmq

from engine.kv_events.config import KVEventsConfig
from engine.kv_events.wire import KVEventBatch

logger = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
CLOSE_TIMEOUT_S = 2.0  # how long `close` lets the thread send what is queued
LINGER_MS = 500  # and how long the socket then has to hand it over
_POLL_S = 0.05  # the thread looks at replay requests at least this often


class ZmqEventPublisher:
    def __init__(self, config: KVEventsConfig) -> None:
        self._queue: queue.Queue[KVEventBatch | None] = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._topic = config.topic.encode("utf-8")
        self._context = zmq.Context()
        self._pub = self._context.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, config.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._replay = None
        self.num_dropped = 0  # batches dropped because the queue was full
        try:
            if _binds(config.endpoint):  # a stable side binds, a volatile one connects (vLLM's rule)
                self._pub.bind(config.endpoint)
            else:
                self._pub.connect(config.endpoint)
            if config.replay_endpoint is not None:
                self._replay = self._context.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(config.replay_endpoint)
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise ValueError(
                f"kv_events_config: cannot open {config.endpoint!r} or its replay endpoint: {exc}"
            ) from None
        self._thread = threading.Thread(target=self._run, name="kv-events-publisher", daemon=True)
        self._thread.start()
        logger.info("KV events: publishing on %s (replay: %s)", config.endpoint, config.replay_endpoint)

    def publish(self, events: list) -> None:
        """Queue one step's events as a batch (returns at once)."""
        try:
            self._queue.put_nowait(KVEventBatch(ts=time.time(), events=events, data_parallel_rank=0))
        except queue.Full:
            self.num_dropped += 1
            if self.num_dropped == 1 or self.num_dropped % 1000 == 0:
                logger.warning(
                    "KV events: %d batches dropped (the publisher's queue is full; raise max_queue_size)",
                    self.num_dropped,
                )

    def close(self) -> None:
        """Send what is queued (bounded), then stop the thread and close the sockets."""
        try:
            self._queue.put(None, timeout=CLOSE_TIMEOUT_S)
        except queue.Full:
            pass
        self._thread.join(CLOSE_TIMEOUT_S)
        if not self._thread.is_alive():
            self._close_sockets()

    # -- the publisher thread --------------------------------------------------------------------

    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        sequence = itertools.count()
        while True:
            self._serve_replays()
            try:
                batch = self._queue.get(timeout=_POLL_S)
            except queue.Empty:
                continue
            if batch is None:
                return
            try:
                seq, payload = next(sequence), encoder.encode(batch)
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
                self._buffer.append((seq, payload))
            except Exception:  # a publishing failure must never end the thread: log it, go on
                logger.exception("KV events: publishing a batch failed")

    def _serve_replays(self) -> None:
        while self._replay is not None and self._replay.poll(0):
            try:
                frames = self._replay.recv_multipart()
                if len(frames) != 3:
                    logger.warning(
                        "KV events: ignored a replay request of %d frames (expected 3)", len(frames)
                    )
                    continue
                client, _, start = frames
                first = int.from_bytes(start, "big")
                for seq, payload in list(self._buffer):
                    if seq >= first:
                        self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
                self._replay.send_multipart((client, b"", END_SEQ, b""))
            except Exception:
                logger.exception("KV events: serving a replay request failed")

    def _close_sockets(self) -> None:
        self._pub.close(linger=LINGER_MS)  # hand the last batches to subscribers, within bounds
        if self._replay is not None:
            self._replay.close(linger=0)
        self._context.term()


def _binds(endpoint: str) -> bool:
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))
