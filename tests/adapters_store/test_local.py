"""Local-directory specifics: URLs, the publishing rename, leftovers of dead uploads."""

from __future__ import annotations

import os
import time

import pytest

from adapters_store import InvalidAdapter, LocalStore, StoreConfig, StoreUnavailable, open_store
from adapters_store.local import INCOMING_PREFIX


def test_relative_file_url_is_relative_to_the_working_directory(
    tmp_path, monkeypatch, model_shape, adapter_dir
):
    monkeypatch.chdir(tmp_path)
    store = open_store(StoreConfig(url="file://./data/adapters"), model_shape)
    assert isinstance(store, LocalStore)
    assert store.root == tmp_path / "data" / "adapters"
    store.put("acme", "a", adapter_dir)
    monkeypatch.chdir("/")  # the root was fixed when the store opened
    assert (tmp_path / "data/adapters/acme/a/1/manifest.json").is_file()
    assert store.get("acme", "a").version == 1


def test_absolute_file_url(tmp_path, model_shape):
    store = open_store(StoreConfig(url=f"file://{tmp_path}/abs"), model_shape)
    assert store.root == tmp_path / "abs"


def test_a_dead_upload_folder_is_invisible_holds_no_number_and_is_swept(tmp_path, model_shape, adapter_dir):
    store = open_store(StoreConfig(url=f"file://{tmp_path}"), model_shape)
    store.put("acme", "a", adapter_dir)
    # A process killed just before its rename leaves this behind (manifest already written inside):
    dead = tmp_path / "acme" / "a" / f"{INCOMING_PREFIX}dead"
    (tmp_path / "acme/a/1").rename(dead)
    store.put("acme", "a", adapter_dir)
    assert [r.version for r in store.list("acme", all_versions=True)] == [1]
    assert dead.is_dir()  # recent: it might still be running
    old = time.time() - store.config.stale_upload_s - 60
    os.utime(dead, (old, old))
    assert store.put("acme", "a", adapter_dir).version == 2
    assert not dead.exists()


def test_no_temporary_files_remain_after_uploads(tmp_path, model_shape, adapter_dir, archives):
    staging = tmp_path / "staging"
    store = open_store(StoreConfig(url=f"file://{tmp_path}/store", staging_dir=str(staging)), model_shape)
    store.put("acme", "a", archives.tar_gz(adapter_dir))
    with pytest.raises(InvalidAdapter, match="neither a .tar.gz nor a .zip"):
        store.put("acme", "a", b"not an archive")
    assert list(staging.iterdir()) == []
    names = sorted(p.name for p in (tmp_path / "store/acme/a").iterdir())
    assert names == ["1"]
    assert sorted(p.name for p in (tmp_path / "store/acme/a/1").iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
        "manifest.json",
    ]


def test_check_reports_an_unusable_directory(tmp_path):
    (tmp_path / "a-file").write_text("")
    store = open_store(StoreConfig(url=f"file://{tmp_path}/a-file/adapters"))
    with pytest.raises(StoreUnavailable, match="is not writable"):
        store.check()
    open_store(StoreConfig(url=f"file://{tmp_path}/fine")).check()
    assert (tmp_path / "fine").is_dir()


def test_put_needs_the_model_shape(tmp_path, adapter_dir):
    store = open_store(StoreConfig(url=f"file://{tmp_path}"))
    with pytest.raises(RuntimeError, match="ModelShape"):
        store.put("acme", "a", adapter_dir)
