"""Config store: per-tenant routes and hashed API keys, embedded or in Redis, cached for the server.

store = CachedConfigStore(open_config_store(url))
await store.start()          # subscribes to change events
...
await store.close()
"""

from loraserve.config_store.base import ConfigStore
from loraserve.config_store.cache import CachedConfigStore
from loraserve.config_store.embedded import DEFAULT_CONFIG_DIR, EmbeddedConfigStore
from loraserve.config_store.errors import ConfigStoreError, ConfigStoreUnavailable
from loraserve.config_store.events import ConfigEvent, EventCallback
from loraserve.config_store.factory import open_config_store
from loraserve.config_store.redis_store import DEFAULT_PREFIX, RedisConfigStore, redact_url

__all__ = [
    "DEFAULT_CONFIG_DIR",
    "DEFAULT_PREFIX",
    "CachedConfigStore",
    "ConfigEvent",
    "ConfigStore",
    "ConfigStoreError",
    "ConfigStoreUnavailable",
    "EmbeddedConfigStore",
    "EventCallback",
    "RedisConfigStore",
    "open_config_store",
    "redact_url",
]
