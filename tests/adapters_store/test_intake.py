"""Size limits while uploads stream in, and the safetensors header parser."""

from __future__ import annotations

import io
import struct
from pathlib import Path

import pytest
from safetensors import safe_open

from adapter_format.safetensors_header import read_tensor_shapes
from adapters_store import AdapterFiles, InvalidAdapter, UploadTooLarge

WEIGHTS = "adapter_model.safetensors"


class EndlessZeros(io.RawIOBase):
    """A client that never stops sending (after `head`, if given); counts what the store read."""

    def __init__(self, head: bytes = b""):
        self.bytes_read = 0
        self._head = head

    def readable(self):
        return True

    def readinto(self, buffer):
        take = min(len(buffer), len(self._head))
        buffer[:take] = self._head[:take]
        self._head = self._head[take:]
        buffer[take:] = bytes(len(buffer) - take)
        self.bytes_read += len(buffer)
        return len(buffer)


def header_of(weights: Path) -> bytes:
    """The 8-byte length and the JSON header of a safetensors file, without its data."""
    data = weights.read_bytes()
    return data[: 8 + struct.unpack("<Q", data[:8])[0]]


def test_weights_whose_header_describes_too_much_are_refused_before_their_data(
    make_store, keys_of, adapter_dir
):
    store = make_store(max_adapter_bytes=8 << 10)  # the adapter's data is about 15 KiB
    body = EndlessZeros(header_of(adapter_dir / WEIGHTS))
    with pytest.raises(UploadTooLarge, match="8.0 KiB .*max_adapter_bytes") as err:
        store.put("acme", "big", AdapterFiles(config=adapter_dir / "adapter_config.json", weights=body))
    assert err.value.code == "upload_too_large"
    assert body.bytes_read <= (8 << 10) + 1  # it stopped at the header
    assert keys_of(store) == []


def test_an_endless_weights_stream_is_refused_while_streaming(make_store, keys_of, adapter_dir):
    """Past the size its header declares, a stream is refused at once, whatever it would send."""
    store = make_store(max_adapter_bytes=1 << 20)
    body = EndlessZeros(header_of(adapter_dir / WEIGHTS))
    with pytest.raises(InvalidAdapter, match="padded") as err:
        store.put("acme", "big", AdapterFiles(config=adapter_dir / "adapter_config.json", weights=body))
    assert err.value.code == "bad_weights"
    assert body.bytes_read <= (1 << 20) + 1
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
