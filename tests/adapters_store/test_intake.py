"""Size limits while uploads stream in, and the safetensors header parser."""

from __future__ import annotations

import io

import pytest
from safetensors import safe_open

from adapter_format.safetensors_header import read_tensor_shapes
from adapters_store import AdapterFiles, UploadTooLarge

WEIGHTS = "adapter_model.safetensors"


class EndlessZeros(io.RawIOBase):
    """A client that never stops sending; counts what the store read."""

    def __init__(self):
        self.bytes_read = 0

    def readable(self):
        return True

    def readinto(self, buffer):
        buffer[:] = bytes(len(buffer))
        self.bytes_read += len(buffer)
        return len(buffer)


def test_an_oversize_weights_stream_is_refused_while_streaming(make_store, keys_of, adapter_dir):
    store = make_store(max_adapter_bytes=1 << 20)
    body = EndlessZeros()
    with pytest.raises(
        UploadTooLarge, match=r"adapter_model.safetensors is larger than 1.0 MiB \(the max_adapter_bytes"
    ) as err:
        store.put("acme", "big", AdapterFiles(config=adapter_dir / "adapter_config.json", weights=body))
    assert err.value.code == "upload_too_large"
    assert body.bytes_read <= (1 << 20) + 1  # it stopped reading right after the limit
    assert keys_of(store) == []


def test_an_oversize_archive_stream_is_refused_while_streaming(make_store, keys_of):
    store = make_store(max_archive_bytes=1 << 20)
    body = EndlessZeros()
    with pytest.raises(UploadTooLarge, match="the archive is larger than 1.0 MiB") as err:
        store.put("acme", "big", body)
    assert err.value.code == "archive_too_large"
    assert body.bytes_read <= (1 << 20) + 1
    assert keys_of(store) == []


def test_an_oversize_config_is_refused(store, adapter_dir):
    config = b'{"r": 8, "pad": "' + b"x" * (2 << 20) + b'"}'
    with pytest.raises(UploadTooLarge, match="adapter_config.json is larger than 1.0 MiB"):
        store.put("acme", "a", AdapterFiles(config=config, weights=adapter_dir / WEIGHTS))


def test_an_adapter_at_the_limit_is_accepted(make_store, adapter_dir, files_of):
    size = (adapter_dir / WEIGHTS).stat().st_size
    assert make_store(max_adapter_bytes=size).put("acme", "a", files_of(adapter_dir)).size_bytes == size


def test_header_shapes_match_safetensors_own_reader(adapter_dir, other_adapter_dir):
    for folder in (adapter_dir, other_adapter_dir):
        with safe_open(str(folder / WEIGHTS), framework="pt") as f:
            expected = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
        assert read_tensor_shapes(folder / WEIGHTS) == expected
