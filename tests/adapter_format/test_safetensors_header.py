"""The safetensors header reader: names and shapes, strictly checked, without reading tensor data."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import save_file

from adapter_format.errors import AdapterError
from adapter_format.files import WEIGHTS_FILE as WEIGHTS
from adapter_format.safetensors_header import read_tensor_shapes


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
    with pytest.raises(AdapterError, match=message) as err:
        read_tensor_shapes(path)
    assert err.value.code == "bad_weights"


def test_duplicate_tensor_names_are_refused(tmp_path):
    raw = b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, "a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}'
    path = tmp_path / WEIGHTS
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(4))
    with pytest.raises(AdapterError, match="duplicate keys"):
        read_tensor_shapes(path)
