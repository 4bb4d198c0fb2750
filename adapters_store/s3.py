"""The S3 backend (AWS or any S3-compatible endpoint: MinIO, Ceph, R2, moto...).

The endpoint comes from `StoreConfig.endpoint_url`, else from boto3's own resolution, which reads
AWS_ENDPOINT_URL (and AWS_ENDPOINT_URL_S3) natively since botocore 1.31. S3 has no rename, so a
version is committed by writing manifest.json after the other two files. The version number is
claimed by writing adapter_config.json with `If-None-Match: *` (a conditional write): of two
concurrent uploads only one creates it, and the other moves on to the next number. Endpoints that
do not implement conditional writes fall back to plain writes (a warning is logged once). An upload
that fails after its claim removes what it wrote, the claim last, so its number goes to the next one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import closing
from pathlib import Path
from typing import BinaryIO, TypeVar

import boto3
from botocore.config import Config as BotoConfig
from botocore.exceptions import BotoCoreError, ClientError

from adapter_format.files import CONFIG_FILE, WEIGHTS_FILE
from adapter_format.model_shape import ModelShape
from adapter_format.names import format_ref
from adapters_store.base import AdapterStore, MissingKey
from adapters_store.config import StoreConfig
from adapters_store.errors import StoreUnavailable
from adapters_store.filenames import MANIFEST_FILE
from adapters_store.metrics import StoreMetrics
from adapters_store.record import AdapterRecord
from adapters_store.retry import RetryPolicy, call_with_retries
from adapters_store.s3_errors import (
    NOT_FOUND_CODES,
    PRECONDITION_CODES,
    describe,
    error_code,
    hint,
    is_retryable,
)

log = logging.getLogger(__name__)
T = TypeVar("T")
MAX_CLAIM_ATTEMPTS = 100


def make_client(config: StoreConfig):
    """A boto3 S3 client making exactly one attempt per call (retries are ours, see retry.py)."""
    boto_config = BotoConfig(
        connect_timeout=config.connect_timeout_s,
        read_timeout=config.read_timeout_s,
        retries={"total_max_attempts": 1, "mode": "standard"},
        s3={"addressing_style": config.addressing_style},
        # Only the checksums S3 requires: many S3-compatible servers reject the CRC trailers that
        # recent botocore adds by default. Integrity is the store's own sha256 check on download.
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
        max_pool_connections=32,
    )
    session = boto3.session.Session(region_name=config.region)
    return session.client("s3", endpoint_url=config.endpoint_url, config=boto_config)


class S3Store(AdapterStore):
    """Adapters under `s3://bucket/prefix`."""

    def __init__(
        self,
        bucket: str,
        prefix: str,
        config: StoreConfig,
        shape: ModelShape | None = None,
        metrics: StoreMetrics | None = None,
        client=None,
    ):
        """`client`: a boto3 S3 client to share (make one with `make_client`); by default, a new one."""
        super().__init__(config, shape, metrics)
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.client = client or make_client(config)
        self._policy = RetryPolicy(
            config.retries, config.backoff_s, config.max_backoff_s, config.retry_deadline_s
        )
        self._conditional_writes = True

    streams_to_memory = True  # a disk-cache miss reads the bytes straight into memory (engine_source.py)

    def __repr__(self) -> str:
        return f"S3Store('s3://{self.bucket}/{self.prefix}', endpoint={self.client.meta.endpoint_url!r})"

    def __reduce__(self):
        """The same store in another process (an engine loader process), with its own client made from
        the config and the environment; metrics stay behind."""
        return S3Store, (self.bucket, self.prefix, self.config, self.shape)

    def check(self) -> None:
        self._call(f"open bucket {self.bucket}", lambda: self.client.head_bucket(Bucket=self.bucket))

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def _call(self, operation: str, fn: Callable[[], T]) -> T:
        try:
            return call_with_retries(operation, fn, self._policy, is_retryable, describe, self.metrics)
        except ClientError as exc:
            if error_code(exc) in NOT_FOUND_CODES:
                raise MissingKey(operation) from None
            reason = describe(exc)
            raise StoreUnavailable(f"{operation} failed: {reason}; {hint(exc, self.bucket)}", reason) from exc
        except BotoCoreError as exc:
            reason = describe(exc)
            raise StoreUnavailable(f"{operation} failed: {reason}; {hint(exc, self.bucket)}", reason) from exc

    def _list_times(self, prefix: str) -> dict[str, float]:
        full = self._key(prefix)
        times = {}
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=full):
            for obj in page.get("Contents", ()):
                times[obj["Key"][len(full) :]] = obj["LastModified"].timestamp()
        return times

    def _read(self, key: str) -> bytes:
        with self._open(key) as body:
            return body.read()

    def _open(self, key: str) -> closing[BinaryIO]:
        return closing(self.client.get_object(Bucket=self.bucket, Key=self._key(key))["Body"])

    def _write(self, key: str, data: bytes) -> None:
        self.client.put_object(
            Bucket=self.bucket, Key=self._key(key), Body=data, ContentType="application/json"
        )

    def _remove(self, key: str) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=self._key(key))

    def _put_file(self, key: str, path: Path, exclusive: bool = False) -> bool:
        """Upload one file; with `exclusive`, False if the key already exists (someone claimed it)."""
        condition = {"IfNoneMatch": "*"} if exclusive and self._conditional_writes else {}
        with open(path, "rb") as body:
            try:
                self.client.put_object(
                    Bucket=self.bucket,
                    Key=self._key(key),
                    Body=body,
                    ContentLength=path.stat().st_size,
                    **condition,
                )
            except ClientError as exc:
                if condition and error_code(exc) in PRECONDITION_CODES:
                    return False
                if condition and error_code(exc) == "NotImplemented":
                    log.warning(
                        "%s does not support conditional writes; concurrent uploads of one name may race",
                        self.client.meta.endpoint_url,
                    )
                    self._conditional_writes = False
                    return self._put_file(key, path, exclusive)
                raise
        return True

    def _commit(
        self, tenant: str, name: str, folder: Path, record_for: Callable[[int], AdapterRecord]
    ) -> AdapterRecord:
        version = self._next_version(tenant, name)
        for _ in range(MAX_CLAIM_ATTEMPTS):
            prefix = f"{tenant}/{name}/{version}/"
            claimed = self._call(
                f"claim {tenant}/{format_ref(name, version)}",
                lambda p=prefix: self._put_file(p + CONFIG_FILE, folder / CONFIG_FILE, exclusive=True),
            )
            if claimed:
                break
            version += 1  # a concurrent upload holds this number
        else:
            raise StoreUnavailable(
                f"could not claim a version of {tenant}/{name} in {MAX_CLAIM_ATTEMPTS} tries"
            )
        record = record_for(version)
        try:
            self._call(
                f"upload {tenant}/{record.ref}",
                lambda: self._put_file(prefix + WEIGHTS_FILE, folder / WEIGHTS_FILE),
            )
        except Exception:
            self._abandon(prefix, record)
            raise
        try:
            self._call(
                f"commit {tenant}/{record.ref}", lambda: self._write(prefix + MANIFEST_FILE, record.to_json())
            )
        except Exception:
            # The write may have landed with only its answer lost: then the version is committed.
            if self._manifest_landed(tenant, record):
                return record
            self._abandon(prefix, record)
            raise
        return record

    def _manifest_landed(self, tenant: str, record: AdapterRecord) -> bool:
        try:
            return self._read_manifest(tenant, record.name, record.version) == record
        except StoreUnavailable:
            return False

    def _abandon(self, prefix: str, record: AdapterRecord) -> None:
        """Remove what a failed upload wrote, the claim last, so the next upload can take its number.

        Best effort: whatever stays (the store is down) is invisible without a manifest and is swept
        once older than `stale_upload_s`.
        """
        for filename in (MANIFEST_FILE, WEIGHTS_FILE, CONFIG_FILE):
            try:
                self._call(f"clean up {prefix}{filename}", lambda f=filename: self._remove(prefix + f))
            except Exception as exc:  # best effort: the sweep finishes the job
                log.warning("could not clean up the failed upload %s: %s", record.ref, exc)
                return
