"""A disk-cache miss on S3 streams the adapter into memory and lays it out from there (no temporary file on
the load's path); the disk cache is filled behind the load, and a later load reads it from disk."""

from __future__ import annotations

import logging
from collections import Counter

import pytest
import torch

from adapter_format.checkpoint import load_peft_adapter
from adapter_format.files import WEIGHTS_FILE
from adapters_store import AdapterFiles, CountingMetrics, DiskCache, StoreConfig, open_store
from adapters_store.engine_source import StoreAdapterSource
from adapters_store.errors import ChecksumError
from engine.lora.background_loads import RowReader
from engine.lora.host_tier import HostTier
from engine.lora.slots import SlotLayout, build_image


def files(folder) -> AdapterFiles:
    return AdapterFiles(config=folder / "adapter_config.json", weights=folder / WEIGHTS_FILE)


@pytest.fixture
def s3_store(s3_endpoint, s3_bucket, model_shape, fast_retries):
    config = StoreConfig(url=f"s3://{s3_bucket}/p", endpoint_url=s3_endpoint, **fast_retries)
    return open_store(config, model_shape, CountingMetrics())


@pytest.fixture
def adapter_folder(make_peft_adapter):
    return make_peft_adapter(r=8, target_modules=("q_proj", "v_proj", "down_proj"), seed=3)


def make_source(store, cache_dir, events: Counter) -> StoreAdapterSource:
    cache = DiskCache(store, cache_dir, 1 << 30, CountingMetrics())
    return StoreAdapterSource(store, cache, store.shape, 16, observer=lambda e, t, s: events.update([(e, t)]))


def tier_row(shape) -> HostTier:
    return HostTier(SlotLayout(shape, 16), torch.float32, 1, shared=False, pinned=False)


def test_a_miss_streams_into_the_row_and_the_cache_is_filled_behind(
    s3_store, adapter_folder, model_shape, tmp_path, monkeypatch
):
    s3_store.put("acme", "a", files(adapter_folder))
    expected = build_image(
        SlotLayout(model_shape, 16), torch.float32, load_peft_adapter(adapter_folder, model_shape, 16)
    )

    def no_download(*args, **kwargs):
        raise AssertionError("a streamed load must not download through the disk cache")

    events = Counter()
    source = make_source(s3_store, tmp_path / "cache", events)
    tier = tier_row(model_shape)
    with monkeypatch.context() as patch:
        patch.setattr(DiskCache, "_download", no_download)
        reader = RowReader(tier, 0)
        source.load("acme/a@1", reader)
        assert source.wait_for_fills()
    assert reader.origin == "store"
    assert torch.equal(tier.image(0).weights, expected.weights)
    assert torch.equal(tier.image(0).table, expected.table)
    assert events == Counter({("miss", "disk"): 1, ("load", "store"): 1})
    assert source.disk_cache.holds("acme", s3_store.get("acme", "a", 1))
    assert source.disk_cache.metrics.num_misses == 1

    # The next load of it reads the cached folder: no store download, origin "disk".
    monkeypatch.setattr(type(s3_store), "read_record", no_download)
    tier.weights.zero_()
    reader = RowReader(tier, 0)
    source.load("acme/a@1", reader)
    assert reader.origin == "disk"
    assert torch.equal(tier.image(0).weights, expected.weights)
    assert events[("hit", "disk")] == 1


def test_a_failed_cache_fill_costs_only_a_later_download(
    s3_store, adapter_folder, model_shape, tmp_path, monkeypatch, caplog
):
    s3_store.put("acme", "a", files(adapter_folder))

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(DiskCache, "insert", disk_full)
    source = make_source(s3_store, tmp_path / "cache", Counter())
    reader = RowReader(tier_row(model_shape), 0)
    with caplog.at_level(logging.WARNING, logger="adapters_store.engine_source"):
        source.load("acme/a@1", reader)  # the load itself succeeds
        assert source.wait_for_fills()
    assert reader.origin == "store"
    assert "was not written to the disk cache" in caplog.text
    assert not source.disk_cache.holds("acme", s3_store.get("acme", "a", 1))


def test_a_corrupt_object_fails_the_streamed_load_with_the_checksum(
    s3_store, s3_admin, s3_bucket, adapter_folder, model_shape, tmp_path
):
    s3_store.put("acme", "a", files(adapter_folder))
    key = f"p/acme/a/1/{WEIGHTS_FILE}"
    body = bytearray(s3_admin.get_object(Bucket=s3_bucket, Key=key)["Body"].read())
    body[-1] ^= 0xFF  # same size, other bytes
    s3_admin.put_object(Bucket=s3_bucket, Key=key, Body=bytes(body))
    with pytest.raises(ChecksumError, match="sha256"):
        s3_store.read_record("acme", s3_store.get("acme", "a", 1))
    source = make_source(s3_store, tmp_path / "cache", Counter())
    with pytest.raises(Exception, match="could not be fetched from the store.*sha256"):
        source.load("acme/a@1", RowReader(tier_row(model_shape), 0))
    assert source.wait_for_fills()
    assert not source.disk_cache.holds("acme", s3_store.get("acme", "a", 1))  # nothing cached


def test_a_local_store_and_a_folder_reader_still_go_through_the_disk_cache(
    s3_store, adapter_folder, model_shape, tmp_path
):
    local = open_store(StoreConfig(url=f"file://{tmp_path / 'store'}"), model_shape, CountingMetrics())
    local.put("acme", "a", files(adapter_folder))
    assert not local.streams_to_memory and s3_store.streams_to_memory
    source = make_source(local, tmp_path / "cache-local", Counter())
    reader = RowReader(tier_row(model_shape), 0)
    source.load("acme/a@1", reader)
    assert reader.origin == "store"  # fetched (linked) into the disk cache, then read from it
    assert source.disk_cache.holds("acme", local.get("acme", "a", 1))
    # A plain folder reader (no from_memory) on S3: the disk cache path, which PeftAdapter loads take.
    s3_store.put("acme", "b", files(adapter_folder))
    s3_source = make_source(s3_store, tmp_path / "cache-s3", Counter())
    adapter = s3_source.load("acme/b@1")
    assert adapter.rank == 8
    assert s3_source.disk_cache.holds("acme", s3_store.get("acme", "b", 1))
