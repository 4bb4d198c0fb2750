"""Adapter storage: S3 and local-directory backends behind one interface.

store = open_store(StoreConfig(url="s3://bucket/adapters", max_lora_rank=16), shape)
record = store.put("acme", "support-bot", AdapterFiles(config=cfg_stream, weights=st_stream))
cache = DiskCache(store, config.cache_dir, config.cache_max_bytes)
with cache.checkout("acme", record) as cached:
    adapter = load_peft_adapter(cached.path, shape, max_lora_rank)
"""

from adapter_format.names import format_ref, parse_ref
from adapters_store.base import AdapterStore
from adapters_store.cache import CachedAdapter, DiskCache
from adapters_store.config import StoreConfig, parse_store_url
from adapters_store.errors import (
    AdapterNotFound,
    ChecksumError,
    DiskFull,
    InvalidAdapter,
    InvalidName,
    StoreError,
    StoreUnavailable,
    UploadTooLarge,
)
from adapters_store.factory import open_store
from adapters_store.intake import AdapterFiles, Staged, UploadSource
from adapters_store.local import LocalStore
from adapters_store.metrics import CountingMetrics, StoreMetrics
from adapters_store.record import AdapterRecord

__all__ = [
    "AdapterFiles",
    "AdapterNotFound",
    "AdapterRecord",
    "AdapterStore",
    "CachedAdapter",
    "ChecksumError",
    "CountingMetrics",
    "DiskFull",
    "DiskCache",
    "InvalidAdapter",
    "InvalidName",
    "LocalStore",
    "StoreConfig",
    "Staged",
    "StoreError",
    "StoreMetrics",
    "StoreUnavailable",
    "UploadSource",
    "UploadTooLarge",
    "format_ref",
    "open_store",
    "parse_ref",
    "parse_store_url",
]
