"""Open the store a URL names: `file:///abs/dir`, `file://./rel/dir` or `s3://bucket/prefix`."""

from __future__ import annotations

from adapter_format.model_shape import ModelShape
from adapters_store.base import AdapterStore
from adapters_store.config import StoreConfig
from adapters_store.local import LocalStore
from adapters_store.metrics import StoreMetrics


def open_store(
    config: StoreConfig, shape: ModelShape | None = None, metrics: StoreMetrics | None = None
) -> AdapterStore:
    """The backend for `config.url`; nothing is contacted yet.

    `shape` (the base model's) is needed only by put(). Call `store.check()` at startup to fail early
    on a missing bucket, bad credentials or an unwritable folder.
    """
    location = config.location
    if location.scheme == "s3":
        from adapters_store.s3 import S3Store  # boto3 loads only when S3 is used

        return S3Store(location.bucket, location.prefix, config, shape, metrics)
    return LocalStore(location.path, config, shape, metrics)
