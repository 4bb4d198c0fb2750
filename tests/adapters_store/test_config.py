"""Pure logic, table-driven: config validation, URLs, names and references, records, backoff."""

from __future__ import annotations

from pathlib import Path

import pytest

from adapter_format.names import check_name, parse_version
from adapters_store import AdapterRecord, InvalidName, StoreConfig, parse_ref, parse_store_url
from adapters_store.retry import RetryPolicy, backoff_delay


@pytest.mark.parametrize(
    "url, expected",
    [
        ("file:///srv/adapters", ("file", Path("/srv/adapters"), None, "")),
        ("file://localhost/srv/adapters", ("file", Path("/srv/adapters"), None, "")),
        ("file://./.loraserve/adapters", ("file", Path(".loraserve/adapters"), None, "")),
        ("file://../up", ("file", Path("../up"), None, "")),
        ("./plain/path", ("file", Path("plain/path"), None, "")),
        ("s3://bucket/some/prefix/", ("s3", None, "bucket", "some/prefix")),
        ("s3://bucket", ("s3", None, "bucket", "")),
    ],
)
def test_store_urls(url, expected):
    location = parse_store_url(url)
    assert (location.scheme, location.path, location.bucket, location.prefix) == expected


@pytest.mark.parametrize(
    "url, message",
    [
        ("", "empty"),
        ("s3:///prefix", "names no bucket"),
        ("file://otherhost/dir", "file URLs are local"),
        ("http://example.com/x", "scheme 'http'"),
    ],
)
def test_bad_store_urls(url, message):
    with pytest.raises(ValueError, match=message):
        parse_store_url(url)


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("url", "gs://bucket", "scheme 'gs'"),
        ("max_lora_rank", 0, "max_lora_rank must be a positive integer"),
        ("max_adapter_bytes", -1, "max_adapter_bytes must be a positive integer"),
        ("max_archive_files", 1.5, "max_archive_files must be a positive integer"),
        ("max_archive_bytes", True, "max_archive_bytes must be a positive integer"),
        ("cache_max_bytes", 0, "cache_max_bytes"),
        ("retries", -1, "retries must be a non-negative integer"),
        ("backoff_s", -0.1, "backoff_s must be a non-negative number"),
        ("max_backoff_s", 0.01, r"max_backoff_s \(0.01\) must be at least backoff_s"),
        ("connect_timeout_s", 0, "connect_timeout_s must be a positive number"),
        ("read_timeout_s", "5", "read_timeout_s must be a positive number"),
        ("retry_deadline_s", -1, "retry_deadline_s must be a non-negative number"),
        ("endpoint_url", "localhost:9000", "must start with http:// or https://"),
        ("addressing_style", "dns", "addressing_style must be one of auto, path, virtual"),
    ],
)
def test_store_config_validation(field, value, message):
    with pytest.raises(ValueError, match=message):
        StoreConfig(**{field: value})


def test_store_config_defaults():
    config = StoreConfig()
    assert config.url == "file://./.loraserve/adapters"
    assert config.max_adapter_bytes == 1 << 30
    assert config.location.scheme == "file"
    # A hung S3 fails a call within seconds: the last retry starts before the deadline, then one read times out.
    assert config.retry_deadline_s + config.connect_timeout_s + config.read_timeout_s <= 20


@pytest.mark.parametrize(
    "ref, expected",
    [("support-bot", ("support-bot", None)), ("a.b_c-1@12", ("a.b_c-1", 12)), ("X@1", ("X", 1))],
)
def test_parse_ref(ref, expected):
    assert parse_ref(ref) == expected


@pytest.mark.parametrize("ref", ["a@", "a@0", "a@01", "a@-1", "a@x", "a@1@2", "@1", "a/b@1"])
def test_bad_refs(ref):
    with pytest.raises(InvalidName):
        parse_ref(ref)


@pytest.mark.parametrize("name", ["a", "A9", "x" * 64, "my.adapter_v2-final", "0start"])
def test_good_names(name):
    assert check_name(name) == name


@pytest.mark.parametrize("name", ["", "x" * 65, "-lead", ".hidden", "a..b", "a b", "a@b", "a/b", "é", 7])
def test_bad_names(name):
    with pytest.raises(InvalidName):
        check_name(name)


@pytest.mark.parametrize(
    "segment, expected", [("1", 1), ("42", 42), ("0", None), ("01", None), (".incoming-x", None)]
)
def test_parse_version(segment, expected):
    assert parse_version(segment) == expected


RECORD = AdapterRecord(
    name="a",
    version=3,
    rank=8,
    alpha=16.0,
    target_modules=("q_proj", "v_proj"),
    base_model=None,
    sha256="ab" * 32,
    size_bytes=123,
    created_at="2025-01-31T12:00:00Z",
)


def test_record_json_round_trip():
    assert AdapterRecord.from_json(RECORD.to_json()) == RECORD
    assert RECORD.ref == "a@3"
    assert RECORD.to_dict()["target_modules"] == ["q_proj", "v_proj"]


@pytest.mark.parametrize(
    "data, message",
    [
        (b"{", "not valid JSON"),
        (b"[]", "JSON object"),
        (b'{"name": "a"}', "missing or mistypes"),
        (RECORD.to_json().replace(b"ab" * 32, b"zz"), "64 lowercase hex"),
    ],
)
def test_bad_manifests(data, message):
    with pytest.raises(ValueError, match=message):
        AdapterRecord.from_json(data)


@pytest.mark.parametrize(
    "attempt, rand, expected",
    [
        (0, 1.0, 0.5),
        (1, 1.0, 1.0),
        (2, 1.0, 2.0),
        (3, 1.0, 3.0),
        (10, 1.0, 3.0),
        (2, 0.25, 0.5),
        (5, 0.0, 0.0),
    ],
)
def test_backoff_is_exponential_capped_and_jittered(attempt, rand, expected):
    policy = RetryPolicy(retries=5, backoff_s=0.5, max_backoff_s=3.0)
    assert backoff_delay(attempt, policy, rand=lambda: rand) == pytest.approx(expected)
