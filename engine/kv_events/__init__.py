"""KV-cache events for cluster routers, as vLLM publishes them (`kv_events_config`, `--kv-events-config`).

config.py: the settings (vLLM's keys); wire.py: the message layout; recorder.py: what the KV cache
records each step; publisher.py: the ZeroMQ PUB socket and its replay ROUTER socket.
"""

from engine.kv_events.config import KVEventsConfig
from engine.kv_events.recorder import KVEventRecorder

__all__ = ["KVEventRecorder", "KVEventsConfig"]
