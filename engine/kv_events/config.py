"""`kv_events_config`, as vLLM names it (`--kv-events-config JSON`); validated once, here.

vLLM's keys and defaults: `enable_kv_cache_events` (false), `publisher` ("zmq" when events are enabled,
else "null"), `endpoint` ("tcp://*:5557": a wildcard, `::`, ipc:// or inproc:// address is bound, any
other is connected to), `replay_endpoint` (none: no replay), `buffer_steps` (10,000 batches kept for
replay), `hwm` (the PUB socket's high-water mark, 100,000), `max_queue_size` (100,000 batches waiting
for the publisher thread) and `topic` (""). One key is loraserve's: `event_encoding`, "array" (every
struct positional, as vLLM published events before vLLM #42892 and as every router decodes) or "map"
(each event a map tagged by its "type" key inside the positional batch, as vLLM publishes since #42892).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

PUBLISHERS = ("null", "zmq")
EVENT_ENCODINGS = ("array", "map")


@dataclass(frozen=True)
class KVEventsConfig:
    enable_kv_cache_events: bool = False
    publisher: str | None = None  # None: "zmq" when events are enabled, else "null" (vLLM's rule)
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""
    event_encoding: str = "array"

    def __post_init__(self) -> None:
        if not isinstance(self.enable_kv_cache_events, bool):
            raise ValueError(
                f"kv_events_config: enable_kv_cache_events must be true or false (got {self.enable_kv_cache_events!r})"
            )
        if self.publisher is None:
            object.__setattr__(self, "publisher", "zmq" if self.enable_kv_cache_events else "null")
        if self.publisher not in PUBLISHERS:
            raise ValueError(
                f"kv_events_config: publisher must be one of {', '.join(PUBLISHERS)} (got {self.publisher!r})"
            )
        if not isinstance(self.endpoint, str) or "://" not in self.endpoint:
            raise ValueError(
                f"kv_events_config: endpoint must be a ZeroMQ address such as tcp://*:5557 (got {self.endpoint!r})"
            )
        if self.replay_endpoint is not None and (
            not isinstance(self.replay_endpoint, str) or "://" not in self.replay_endpoint
        ):
            raise ValueError(
                "kv_events_config: replay_endpoint must be a ZeroMQ address such as tcp://*:5558 "
                f"(got {self.replay_endpoint!r})"
            )
        for name, low in (("buffer_steps", 0), ("hwm", 0), ("max_queue_size", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"kv_events_config: {name} must be an integer >= {low} (got {value!r})")
        if not isinstance(self.topic, str):
            raise ValueError(f"kv_events_config: topic must be a string (got {self.topic!r})")
        if self.event_encoding not in EVENT_ENCODINGS:
            raise ValueError(
                f"kv_events_config: event_encoding must be one of {', '.join(EVENT_ENCODINGS)} "
                f"(got {self.event_encoding!r})"
            )

    @property
    def publishes(self) -> bool:
        """Events are recorded and sent over ZeroMQ (vLLM records them only when enabled)."""
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @classmethod
    def parse(cls, value: KVEventsConfig | dict[str, Any] | str | None) -> KVEventsConfig | None:
        """A config from a dict or its JSON text (the CLI's form); ValueError naming unknown keys."""
        if value is None or isinstance(value, KVEventsConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                raise ValueError(
                    f"kv_events_config is not valid JSON (got {value!r}); e.g. "
                    '{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557"}'
                ) from None
        if not isinstance(value, dict):
            raise ValueError(f"kv_events_config must be a JSON object (got {type(value).__name__})")
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(value) - set(known))
        if unknown:
            raise ValueError(f"kv_events_config: unknown keys {unknown}; the keys are {', '.join(known)}")
        return cls(**value)
