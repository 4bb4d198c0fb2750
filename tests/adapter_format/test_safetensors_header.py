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


def test_read_tensors_gives_what_safetensors_reads(tmp_path):
    from safetensors import safe_open

    from adapter_format.safetensors_header import read_tensors

    path = tmp_path / WEIGHTS
    gen = torch.Generator().manual_seed(0)
    tensors = {
        f"t{i}": torch.randn(3, 5, generator=gen).to(dtype)
        for i, dtype in enumerate((torch.float64, torch.float32, torch.float16, torch.bfloat16))
    }
    tensors["empty"] = torch.zeros(0, 4)
    save_file(tensors, path)
    shapes, read = read_tensors(path, check=lambda shapes: shapes)
    assert shapes == {name: tuple(t.shape) for name, t in tensors.items()}
    with safe_open(str(path), framework="pt") as f:
        for name in f.keys():
            assert read[name].dtype == f.get_tensor(name).dtype
            assert torch.equal(read[name], f.get_tensor(name))


def test_read_tensors_handles_offsets_not_aligned_to_the_dtype(tmp_path):
    from adapter_format.safetensors_header import read_tensors

    half = torch.tensor([1.5], dtype=torch.float16)  # 2 bytes: the F32 tensor after it starts at byte 2
    single = torch.tensor([2.25, -3.0], dtype=torch.float32)
    header = {
        "h": {"dtype": "F16", "shape": [1], "data_offsets": [0, 2]},
        "f": {"dtype": "F32", "shape": [2], "data_offsets": [2, 10]},
    }
    write_raw(tmp_path / WEIGHTS, header, half.view(torch.uint8).numpy().tobytes() + single.numpy().tobytes())
    _, read = read_tensors(tmp_path / WEIGHTS)
    assert torch.equal(read["h"], half) and torch.equal(read["f"], single)


def test_read_tensors_reads_no_data_when_the_check_refuses_the_header(tmp_path, monkeypatch):
    from adapter_format.safetensors_header import read_tensors

    save_file({"a": torch.zeros(4)}, tmp_path / WEIGHTS)

    def refuse(shapes):
        raise AdapterError("shape_mismatch", "not for this model")

    monkeypatch.setattr("builtins.bytearray", None)  # reading the data would fail differently
    with pytest.raises(AdapterError, match="not for this model"):
        read_tensors(tmp_path / WEIGHTS, check=refuse)
