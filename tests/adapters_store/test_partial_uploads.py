"""Failed, cut and dead uploads leave no version behind and burn no version number; sweeps clean up.

S3 runs against moto's server over real HTTP, through a loopback proxy that cuts the connection in the
middle of the weights' PUT, or with botocore's event hooks failing one kind of request.
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlparse

import pytest
from botocore.exceptions import ConnectionClosedError
from s3_cut_proxy import CutProxy
from test_s3 import FAULTS, inject

from adapters_store import CountingMetrics, DiskFull, StoreConfig, StoreUnavailable, open_store
from adapters_store.versions import VersionKeys, scan_versions, sweepable

WEIGHTS = "adapter_model.safetensors"
CONFIG = "adapter_config.json"
HOUR = 3600.0


@pytest.mark.parametrize(
    ("files", "now", "expected"),
    [
        ({"manifest.json": 0, CONFIG: 0, WEIGHTS: 0}, 10 * HOUR, []),  # committed
        ({CONFIG: 0, WEIGHTS: 0}, 0.5 * HOUR, []),  # partial, maybe still uploading
        ({CONFIG: 0, WEIGHTS: 0.9 * HOUR}, 1.5 * HOUR, []),  # its newest key is what counts
        ({CONFIG: 0, WEIGHTS: 0}, 1.5 * HOUR, [WEIGHTS, CONFIG]),  # a dead upload, its claim last
        ({"deleted.json": 0}, 10 * HOUR, []),  # a tombstone keeps its number forever
        ({"deleted.json": 0, "manifest.json": 0, WEIGHTS: 0}, 0, ["manifest.json", WEIGHTS]),  # failed delete
    ],
)
def test_sweepable(files, now, expected):
    swept = sweepable({3: VersionKeys(dict(files))}, now, HOUR)
    assert swept == ([(3, expected)] if expected else [])


def test_scan_versions_reads_only_numbered_folders():
    keys = {"1/manifest.json": 1.0, "2/deleted.json": 2.0, ".incoming-x/a": 3.0, "07/a": 4.0, "3/x/y": 5.0}
    versions = scan_versions(keys)
    assert sorted(versions) == [1, 2]
    assert versions[1].committed and versions[2].deleted and not versions[2].committed


def later(store, seconds: float = 2 * HOUR) -> None:
    """Move the store's clock forward, as if the keys it sees had aged."""
    real = store.clock
    store.clock = lambda: real() + seconds


def test_a_dead_upload_keeps_its_number_while_it_may_be_running_then_is_swept(
    store, adapter_dir, files_of, keys_of
):
    store.put("acme", "a", files_of(adapter_dir))
    # What an upload that died after its files, before its manifest, leaves behind:
    store._write(f"acme/a/2/{CONFIG}", (adapter_dir / CONFIG).read_bytes())
    store._write(f"acme/a/2/{WEIGHTS}", (adapter_dir / WEIGHTS).read_bytes())
    store._write(f"acme/b/1/{CONFIG}", b"{}")
    assert [r.ref for r in store.list("acme", all_versions=True)] == ["a@1"]
    later(store)
    assert store.put("acme", "a", files_of(adapter_dir)).version == 2  # the dead upload's number
    assert store.sweep() == 1  # b's dead upload (a's was swept by the upload)
    assert keys_of(store) == sorted(
        f"acme/a/{v}/{f}" for v in (1, 2) for f in (CONFIG, WEIGHTS, "manifest.json")
    )


def test_sweep_spares_young_uploads_and_tombstones(store, adapter_dir, files_of, keys_of):
    store.put("acme", "a", files_of(adapter_dir))
    store.put("acme", "a", files_of(adapter_dir))
    store.delete("acme", "a", 1)
    store._write(f"acme/a/3/{CONFIG}", b"{}")  # an upload in progress on another replica
    store._write(f"other/b/1/{CONFIG}", b"{}")
    assert store.sweep() == 0
    assert f"acme/a/3/{CONFIG}" in keys_of(store) and f"other/b/1/{CONFIG}" in keys_of(store)
    later(store)
    assert store.sweep() == 2
    assert [k for k in keys_of(store) if not k.startswith("acme/a/2/")] == ["acme/a/1/deleted.json"]
    assert store.put("acme", "a", files_of(adapter_dir)).version == 3  # 1 stays deleted


def test_a_delete_that_fails_midway_hides_the_version_and_the_sweep_finishes_it(
    store, adapter_dir, files_of, keys_of, monkeypatch
):
    store.put("acme", "a", files_of(adapter_dir))
    real_remove = store._remove

    def remove(key):
        if key.endswith(WEIGHTS):
            raise StoreUnavailable("injected")
        real_remove(key)

    monkeypatch.setattr(store, "_remove", remove)
    with pytest.raises(StoreUnavailable):
        store.delete("acme", "a", 1)
    monkeypatch.undo()
    assert store.list("acme") == []  # the tombstone came first
    assert store.put("acme", "a", files_of(adapter_dir)).version == 2  # and keeps number 1 taken
    assert keys_of(store)[:2] == ["acme/a/1/deleted.json", "acme/a/2/adapter_config.json"]


def test_a_failed_local_upload_leaves_nothing_and_frees_its_number(
    tmp_path, model_shape, adapter_dir, monkeypatch
):
    from adapters_store import local

    store = open_store(StoreConfig(url=f"file://{tmp_path}/store"), model_shape)
    store.put("acme", "a", adapter_dir)
    real_fsync = local.fsync_path

    def fsync(path):
        if Path(path).name == WEIGHTS:
            raise OSError(28, "No space left on device")
        real_fsync(path)

    monkeypatch.setattr(local, "fsync_path", fsync)
    with pytest.raises(DiskFull, match="disk is full"):  # 507 over HTTP, not a store outage
        store.put("acme", "a", adapter_dir)
    monkeypatch.undo()
    assert sorted(p.name for p in (tmp_path / "store/acme/a").iterdir()) == ["1"]
    assert store.put("acme", "a", adapter_dir).version == 2


# ---- S3: failures injected on the way -------------------------------------------------------------


@pytest.fixture
def s3_store(s3_endpoint, s3_bucket, model_shape, fast_retries):
    config = StoreConfig(url=f"s3://{s3_bucket}/p", endpoint_url=s3_endpoint, **fast_retries)
    return open_store(config, model_shape, CountingMetrics())


def test_a_failed_commit_removes_what_it_wrote(s3_store, adapter_dir, files_of, keys_of):
    s3_store.put("acme", "a", files_of(adapter_dir))
    manifest_put = lambda request: request.url.endswith("manifest.json")  # noqa: E731
    calls = inject(s3_store, "PutObject", FAULTS["connection_refused"], times=3, only=manifest_put)
    with pytest.raises(StoreUnavailable, match="commit acme/a@2 failed"):
        s3_store.put("acme", "a", files_of(adapter_dir))
    assert calls["failed"] == 3
    assert [k for k in keys_of(s3_store) if "/2/" in k] == []
    assert s3_store.put("acme", "a", files_of(adapter_dir)).version == 2


def test_a_commit_whose_answer_was_lost_is_committed(s3_store, adapter_dir, files_of):
    lost = {"n": 0}

    def after_call(http_response, **_):
        if http_response.url.endswith("manifest.json"):
            lost["n"] += 1
            raise ConnectionClosedError(endpoint_url="http://lost")  # the write landed; its answer did not

    s3_store.client.meta.events.register("after-call.s3.PutObject", after_call)
    record = s3_store.put("acme", "a", files_of(adapter_dir))
    assert lost["n"] == 3
    assert s3_store.get("acme", "a") == record


# ---- S3: the connection cut in the middle of the weights' upload ----------------------------------


@pytest.fixture
def proxy(s3_endpoint):
    proxy = CutProxy(urlparse(s3_endpoint).port)
    yield proxy
    proxy.close()


@pytest.fixture
def proxied_store(proxy, s3_bucket, model_shape, fast_retries):
    config = StoreConfig(url=f"s3://{s3_bucket}/p", endpoint_url=proxy.url, **fast_retries)
    return open_store(config, model_shape, CountingMetrics())


def weights_put(bucket: str, version: int) -> bytes:
    return f"PUT /{bucket}/p/acme/a/{version}/{WEIGHTS}".encode()


def test_a_cut_upload_leaves_no_object_and_its_number_goes_to_the_next(
    proxy, proxied_store, s3_bucket, adapter_dir, files_of, keys_of
):
    proxied_store.put("acme", "a", files_of(adapter_dir))
    # Cut every attempt 2 KiB into the request (headers and part of the 20 KiB of weights).
    proxy.cut(weights_put(s3_bucket, 2), after_bytes=2048, times=3)
    with pytest.raises(StoreUnavailable, match="upload acme/a@2 failed after 3 attempts"):
        proxied_store.put("acme", "a", files_of(adapter_dir))
    assert proxy.num_cuts == 3
    assert keys_of(proxied_store) == [f"acme/a/1/{f}" for f in (CONFIG, WEIGHTS, "manifest.json")]
    record = proxied_store.put("acme", "a", files_of(adapter_dir))
    assert record.version == 2
    assert [r.version for r in proxied_store.versions("acme", "a")] == [1, 2]


def test_one_cut_is_retried_and_leaves_one_whole_version(
    proxy, proxied_store, s3_bucket, adapter_dir, files_of, keys_of, tmp_path
):
    proxy.cut(weights_put(s3_bucket, 1), after_bytes=2048, times=1)
    record = proxied_store.put("acme", "a", files_of(adapter_dir))
    assert (proxy.num_cuts, record.version) == (1, 1)
    folder = proxied_store.fetch("acme", "a", 1, tmp_path / "out")  # checked against its sha256
    assert (folder / WEIGHTS).read_bytes() == (adapter_dir / WEIGHTS).read_bytes()
    assert keys_of(proxied_store) == [f"acme/a/1/{f}" for f in (CONFIG, WEIGHTS, "manifest.json")]
