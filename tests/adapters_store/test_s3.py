"""S3 specifics against moto's server over real HTTP: retries under injected faults, endpoints, claims.

Faults are injected with botocore's own event hooks on the store's real client, so every request
that is not failed on purpose goes through botocore and HTTP to the server.
"""

from __future__ import annotations

import pytest
from botocore.awsrequest import AWSResponse
from botocore.exceptions import (
    ConnectionClosedError,
    EndpointConnectionError,
    ReadTimeoutError,
    ResponseStreamingError,
)

from adapters_store import CountingMetrics, StoreConfig, StoreUnavailable, open_store
from adapters_store.s3 import S3Store

WEIGHTS = "adapter_model.safetensors"


class _Raw:
    def __init__(self, body: bytes):
        self.body = body

    def stream(self, **_):
        yield self.body


def error_response(status: int, code: str, message: str = "injected") -> AWSResponse:
    body = f"<Error><Code>{code}</Code><Message>{message}</Message></Error>".encode()
    return AWSResponse("http://injected", status, {"Content-Type": "application/xml"}, _Raw(body))


FAULTS = {
    "500_internal_error": lambda: error_response(500, "InternalError"),
    "503_slow_down": lambda: error_response(503, "SlowDown", "Please reduce your request rate."),
    "429_too_many": lambda: error_response(429, "TooManyRequests"),
    "connection_refused": EndpointConnectionError(endpoint_url="http://127.0.0.1"),
    "connection_reset": ConnectionClosedError(endpoint_url="http://127.0.0.1"),
    "read_timeout": ReadTimeoutError(endpoint_url="http://127.0.0.1"),
}


def inject(store: S3Store, operation: str, fault, times: int | None, only=lambda request: True) -> dict:
    """Fail the first `times` matching requests of `operation` (None: all of them); counts the calls."""
    calls = {"matching": 0, "failed": 0}

    def before_send(request, **_):
        if not only(request):
            return None
        calls["matching"] += 1
        if times is not None and calls["failed"] >= times:
            return None
        calls["failed"] += 1
        if isinstance(fault, Exception):
            raise fault
        return fault()

    store.client.meta.events.register(f"before-send.s3.{operation}", before_send)
    return calls


@pytest.fixture
def s3_store(s3_endpoint, s3_bucket, model_shape, fast_retries) -> S3Store:
    config = StoreConfig(url=f"s3://{s3_bucket}/p", endpoint_url=s3_endpoint, **fast_retries)
    return open_store(config, model_shape, CountingMetrics())


@pytest.mark.parametrize("fault", list(FAULTS.values()), ids=list(FAULTS))
def test_transient_faults_are_retried_until_success(s3_store, adapter_dir, files_of, tmp_path, fault):
    record = s3_store.put("acme", "a", files_of(adapter_dir))
    calls = inject(s3_store, "GetObject", fault, times=2)
    assert s3_store.get("acme", "a") == record
    s3_store.fetch("acme", "a", 1, tmp_path / "out")
    assert calls["failed"] == 2
    assert s3_store.metrics.num_retries == 2


def test_an_upload_survives_faults_on_every_step(s3_store, adapter_dir, files_of):
    inject(s3_store, "PutObject", FAULTS["connection_refused"], times=1)
    inject(s3_store, "ListObjectsV2", FAULTS["503_slow_down"], times=1)
    record = s3_store.put("acme", "a", files_of(adapter_dir))
    assert record.version == 1
    assert s3_store.metrics.num_retries == 2
    assert [r.ref for r in s3_store.list("acme")] == ["a@1"]


def test_persistent_faults_raise_store_unavailable_with_the_reason(s3_store):
    calls = inject(s3_store, "ListObjectsV2", FAULTS["500_internal_error"], times=None)
    with pytest.raises(
        StoreUnavailable, match=r"failed after 3 attempts: InternalError \(HTTP 500\): injected"
    ) as err:
        s3_store.list("acme")
    assert err.value.reason == "InternalError (HTTP 500): injected"
    assert err.value.code == "store_unavailable"
    assert (
        calls["matching"] == 3
    )  # retries=2: one attempt plus two retries, never multiplied by botocore's own


def test_access_denied_is_not_retried(s3_store):
    calls = inject(
        s3_store, "ListObjectsV2", lambda: error_response(403, "AccessDenied", "Access Denied"), times=None
    )
    with pytest.raises(StoreUnavailable, match="AccessDenied .*check the AWS credentials"):
        s3_store.list("acme")
    assert calls["matching"] == 1


def test_a_body_cut_off_midway_is_downloaded_again(s3_store, adapter_dir, files_of, tmp_path):
    record = s3_store.put("acme", "a", files_of(adapter_dir))
    cut = {"done": False}

    class CutBody:
        def __init__(self, body):
            self.body = body

        def read(self, amt=None):
            self.body.read(100)
            raise ResponseStreamingError(error="connection reset by peer")

        def close(self):
            self.body.close()

    def after_call(parsed, model, **_):
        if not cut["done"] and parsed.get("ContentLength") == record.size_bytes:
            cut["done"] = True
            parsed["Body"] = CutBody(parsed["Body"])

    s3_store.client.meta.events.register("after-call.s3.GetObject", after_call)
    folder = s3_store.fetch("acme", "a", 1, tmp_path / "out")
    assert cut["done"]
    assert (folder / WEIGHTS).read_bytes() == (adapter_dir / WEIGHTS).read_bytes()
    assert s3_store.metrics.num_retries == 1


def test_a_failed_weights_upload_leaves_nothing_and_frees_its_number(
    s3_store, adapter_dir, files_of, keys_of
):
    weights_put = lambda request: request.url.endswith(WEIGHTS)  # noqa: E731
    inject(s3_store, "PutObject", FAULTS["500_internal_error"], times=3, only=weights_put)
    with pytest.raises(StoreUnavailable, match="upload acme/a@1 failed after 3 attempts"):
        s3_store.put("acme", "a", files_of(adapter_dir))
    assert keys_of(s3_store) == []  # the claim was removed last
    assert s3_store.list("acme") == []
    assert s3_store.put("acme", "a", files_of(adapter_dir)).version == 1


def test_a_version_claimed_concurrently_is_skipped(
    s3_store, adapter_dir, other_adapter_dir, files_of, monkeypatch
):
    first = s3_store.put("acme", "a", files_of(adapter_dir))
    # Another replica listed the same versions at the same time: both try number 1 first.
    monkeypatch.setattr(s3_store, "_next_version", lambda tenant, name: 1)
    second = s3_store.put("acme", "a", files_of(other_adapter_dir))
    assert second.version == 2
    assert s3_store.get("acme", "a", 1) == first  # the conditional write left version 1 untouched


def test_endpoints_without_conditional_writes_fall_back(s3_store, adapter_dir, files_of):
    conditional = lambda request: "If-None-Match" in request.headers  # noqa: E731
    inject(s3_store, "PutObject", lambda: error_response(501, "NotImplemented"), times=None, only=conditional)
    assert s3_store.put("acme", "a", files_of(adapter_dir)).version == 1
    assert s3_store._conditional_writes is False


def test_the_prefix_holds_the_layout(s3_endpoint, s3_bucket, s3_admin, adapter_dir, files_of, model_shape):
    for url in (f"s3://{s3_bucket}/some/prefix/", f"s3://{s3_bucket}"):
        store = open_store(StoreConfig(url=url, endpoint_url=s3_endpoint), model_shape)
        store.put("acme", "a", files_of(adapter_dir))
    listing = s3_admin.list_objects_v2(Bucket=s3_bucket)
    keys = sorted(obj["Key"] for obj in listing["Contents"])
    assert keys == sorted(
        f"{prefix}acme/a/1/{f}"
        for prefix in ("", "some/prefix/")
        for f in ("adapter_config.json", WEIGHTS, "manifest.json")
    )


def test_aws_endpoint_url_from_the_environment(
    s3_endpoint, s3_bucket, adapter_dir, files_of, model_shape, monkeypatch
):
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint)
    store = open_store(StoreConfig(url=f"s3://{s3_bucket}/x"), model_shape)
    assert store.client.meta.endpoint_url == s3_endpoint
    store.check()
    assert store.put("acme", "a", files_of(adapter_dir)).version == 1
    assert [r.ref for r in store.list("acme")] == ["a@1"]


def test_a_missing_bucket_says_so(s3_endpoint, fast_retries):
    store = open_store(
        StoreConfig(url="s3://no-such-bucket-here/x", endpoint_url=s3_endpoint, **fast_retries)
    )
    with pytest.raises(StoreUnavailable, match="bucket 'no-such-bucket-here' does not exist: create it"):
        store.check()
    with pytest.raises(StoreUnavailable, match="NoSuchBucket"):
        store.list("acme")


def test_an_unreachable_endpoint_fails_after_retries(model_shape, fast_retries, s3_endpoint):
    # s3_endpoint only for its dummy credentials; nothing listens on port 9.
    config = StoreConfig(url="s3://bucket-x/p", endpoint_url="http://127.0.0.1:9", **fast_retries)
    store = open_store(config, model_shape, CountingMetrics())
    with pytest.raises(StoreUnavailable, match="after 3 attempts: EndpointConnectionError") as err:
        store.get("acme", "a")
    assert "check that the adapter store is reachable" in err.value.message
    assert store.metrics.num_retries == 2
