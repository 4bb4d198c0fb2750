"""Size limits while uploads stream in, and the safetensors header parser."""

from __future__ import annotations

import io
import json
import struct

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from adapters_store import AdapterFiles, InvalidAdapter, UploadTooLarge
from adapters_store.safetensors_header import read_tensor_shapes

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


def test_all_float_dtypes_parse(tmp_path):
    path = tmp_path / WEIGHTS
    tensors = {
        f"t{i}": torch.zeros(2, 3, dtype=dtype)
        for i, dtype in enumerate((torch.float64, torch.float32, torch.float16, torch.bfloat16))
    }
    save_file(tensors, path, metadata={"format": "pt"})
    assert read_tensor_shapes(path) == {name: (2, 3) for name in tensors}


def write_raw(path, header: dict, data: bytes = b"") -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


@pytest.mark.parametrize(
    "header, data, message",
    [
        ({"a": {"dtype": "I64", "shape": [1], "data_offsets": [0, 8]}}, bytes(8), "dtype 'I64'"),
        ({"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, bytes(4), "non-negative integers"),
        (
            {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}},
            bytes(4),
            "spans 4 bytes, but F32 \\[2\\] needs 8",
        ),
        ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0]}}, bytes(4), "expected \\[begin, end\\]"),
        (
            {
                "a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
                "b": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
            },
            bytes(8),
            "overlapping or gapped",
        ),
        (
            {"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}},
            bytes(8),
            "starts at byte 4, expected 0",
        ),
        ({"a": "nope"}, b"", "no dtype/shape/data_offsets"),
        ({"__metadata__": {"k": 1}}, b"", "__metadata__ must map strings to strings"),
    ],
    ids=[
        "int_dtype",
        "negative_dim",
        "wrong_span",
        "bad_offsets",
        "overlap",
        "gap",
        "not_an_entry",
        "metadata",
    ],
)
def test_malformed_headers(tmp_path, header, data, message):
    path = tmp_path / WEIGHTS
    write_raw(path, header, data)
    with pytest.raises(InvalidAdapter, match=message) as err:
        read_tensor_shapes(path)
    assert err.value.code == "bad_weights"


def test_duplicate_tensor_names_are_refused(tmp_path):
    raw = b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, "a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}'
    path = tmp_path / WEIGHTS
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(4))
    with pytest.raises(InvalidAdapter, match="duplicate keys"):
        read_tensor_shapes(path)
