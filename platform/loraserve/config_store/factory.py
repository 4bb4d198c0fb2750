"""`--config-store URL` -> a backend. The server wraps the result in CachedConfigStore and starts it.

None or ""                       embedded, ./.loraserve/config
file:///abs/dir, file://./rel    embedded under that directory
/some/dir, ./dir                 embedded (a bare path)
redis://..., rediss://..., unix://...   Redis (redis-py URL syntax, db number and password included)
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import unquote, urlsplit

from loraserve.config_store.base import ConfigStore
from loraserve.config_store.embedded import DEFAULT_CONFIG_DIR, EmbeddedConfigStore
from loraserve.config_store.redis_store import DEFAULT_PREFIX, RedisConfigStore

_REDIS_SCHEMES = ("redis", "rediss", "unix")


def open_config_store(url: str | None = None, *, redis_prefix: str = DEFAULT_PREFIX) -> ConfigStore:
    if not url:
        return EmbeddedConfigStore(DEFAULT_CONFIG_DIR)
    parts = urlsplit(url)
    if parts.scheme in _REDIS_SCHEMES:
        return RedisConfigStore(url, prefix=redis_prefix)
    if parts.scheme == "file":
        # file:///abs -> "/abs"; file://./rel -> "./rel" (netloc "." is the relative-path convention we accept)
        path = unquote(parts.netloc + parts.path) if parts.netloc in ("", ".", "..") else None
        if not path:
            raise ValueError(f"config store URL {url!r}: use file:///absolute/dir or file://./relative/dir")
        return EmbeddedConfigStore(Path(path))
    if not parts.scheme:
        return EmbeddedConfigStore(Path(url))
    raise ValueError(
        f"config store URL {url!r} has unsupported scheme {parts.scheme!r}; "
        "use redis://host:6379/0, file:///dir, or omit it for ./.loraserve/config"
    )
