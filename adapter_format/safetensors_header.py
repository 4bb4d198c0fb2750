"""Tensor names and shapes from a safetensors header, without reading any tensor data.

Layout: 8 bytes little-endian header length N, N bytes of JSON
`{"name": {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}`, then the data.
Every field is bounds-checked here (lengths, offsets, sizes), so a file that passes is one
`safetensors.safe_open` accepts, and a pickle renamed to .safetensors is refused with a clear message.
Both the adapter store (on uploads, from the stream before the data is written: `header_length` and
`parse_header` on the bytes as they arrive) and the engine (before `safe_open`, on every load) run it.
"""

from __future__ import annotations

import math
import struct
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from adapter_format.bounded_json import loads_bounded
from adapter_format.errors import AdapterError, show_value

# A LoRA adapter's header lists two tensors per projection and layer: tens of KiB, under 1 MiB for any
# model (the safetensors library itself allows 100 MB). Parsing is bounded in size and depth before
# anything else reads the header.
MAX_HEADER_BYTES = 16 << 20
# {"name": {"shape": [...]}}: three levels; __metadata__ two.
MAX_HEADER_DEPTH = 3
# LoRA weights are floating point; the engine converts any of these to its compute dtype.
DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}
_PICKLE_HINT = (
    "it looks like a pickled PyTorch checkpoint, which is never loaded; save the adapter with safetensors "
    "(save_pretrained(..., safe_serialization=True)) and upload adapter_model.safetensors"
)


@dataclass(frozen=True)
class TensorSpan:
    dtype: str  # a key of DTYPE_BYTES
    shape: tuple[int, ...]
    offset: int  # of its first byte in the file (the header's data offset plus the header's size)
    num_bytes: int


def read_tensor_shapes(path: Path, label: str | None = None) -> dict[str, tuple[int, ...]]:
    """Parse and check the header of `path`; AdapterError('bad_weights') for anything malformed.

    Messages name the file as `label` (default: its name alone, so no server path reaches a user).
    """
    return {name: span.shape for name, span in read_tensor_spans(path, label).items()}


def read_tensor_spans(path: Path, label: str | None = None) -> dict[str, TensorSpan]:
    """`read_tensor_shapes`, with where each tensor's bytes lie in the file (checked to tile the data
    area exactly, within the file's size)."""
    path = Path(path)
    label = label or path.name
    file_size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        header_len = header_length(head, label, file_size)
        raw = f.read(header_len)
    spans, _ = parse_header(raw, head, label, file_size - 8 - header_len)
    return spans


def buffer_tensor_spans(data: bytes | bytearray | memoryview, label: str) -> dict[str, TensorSpan]:
    """`read_tensor_spans` of a safetensors file held in memory (offsets into `data`)."""
    view = memoryview(data).cast("B")
    head = bytes(view[:8])
    header_len = header_length(head, label, len(view))
    spans, _ = parse_header(bytes(view[8 : 8 + header_len]), head, label, len(view) - 8 - header_len)
    return spans


def header_length(head: bytes, label: str, file_size: int | None = None) -> int:
    """The header's length from the file's first 8 bytes, checked against the bounds and, where known, the
    file's size (None: the file is still arriving, as an upload streams in)."""
    # A pickle (b"\x80\x02".. protocol marks) or a zipped torch.save (b"PK") fails one of the next
    # checks; the magic only picks the message, since a valid header length may begin with the same bytes.
    pickled = _looks_pickled(head)
    if len(head) < 8:
        size = len(head) if file_size is None else file_size
        _fail(label, _PICKLE_HINT if pickled else f"it is {size} bytes, too short for a safetensors header")
    (header_len,) = struct.unpack("<Q", head)
    room = MAX_HEADER_BYTES if file_size is None else min(MAX_HEADER_BYTES, file_size - 8)
    if pickled and header_len > room:
        _fail(label, _PICKLE_HINT)
    if file_size is not None and header_len > file_size - 8:
        _fail(
            label,
            f"its header claims {header_len} bytes, but the file holds {file_size} (truncated or corrupt)",
        )
    if header_len > MAX_HEADER_BYTES:
        _fail(
            label,
            f"its header is {header_len} bytes; an adapter's header is far below {MAX_HEADER_BYTES}",
        )
    return header_len


def parse_header(
    raw: bytes, head: bytes, label: str, data_size: int | None = None
) -> tuple[dict[str, TensorSpan], int]:
    """The tensors of header bytes `raw` (after the 8-byte length `head`), and the data bytes they cover,
    which must tile the data area exactly: equal `data_size` where it is known (None: the data is still to
    come, and the caller holds it to the returned size)."""
    header_len = len(raw)
    try:
        header = loads_bounded(raw, MAX_HEADER_DEPTH, object_pairs_hook=_no_duplicates)
    except ValueError as exc:
        _fail(label, _PICKLE_HINT if _looks_pickled(head) else f"its header is not valid JSON ({exc})")
    if not isinstance(header, dict):
        _fail(label, "its header is not a JSON object")
    metadata = header.pop("__metadata__", None)
    if metadata is not None and not (
        isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())
    ):
        _fail(label, "its __metadata__ must map strings to strings")
    tensors: dict[str, TensorSpan] = {}
    spans: list[tuple[int, int, str]] = []
    for name, info in header.items():
        shape, begin, end = _check_entry(label, name, info)
        tensors[name] = TensorSpan(info["dtype"], shape, 8 + header_len + begin, end - begin)
        spans.append((begin, end, name))
    # Tensors must tile the data area exactly: no gaps, no overlaps, nothing past the end.
    position = 0
    for begin, end, name in sorted(spans):
        if begin != position:
            _fail(
                label,
                f"tensor {show_value(name)} starts at byte {begin}, expected {position} (overlapping or gapped data)",
            )
        position = end
    if data_size is not None and position != data_size:
        _fail(
            label,
            f"its tensors cover {position} data bytes, but the file holds {data_size} (truncated or padded)",
        )
    return tensors, position


def _looks_pickled(head: bytes) -> bool:
    return head[:2] == b"PK" or (head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"))


def _check_entry(label: str, name: str, info: object) -> tuple[tuple[int, ...], int, int]:
    if not isinstance(info, dict):
        _fail(label, f"tensor {show_value(name)} has no dtype/shape/data_offsets entry")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if dtype not in DTYPE_BYTES:
        _fail(
            label,
            f"tensor {show_value(name)} has dtype {show_value(dtype)}; LoRA weights must be one of {', '.join(DTYPE_BYTES)}",
        )
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        _fail(
            label,
            f"tensor {show_value(name)} has shape {show_value(shape)}; expected a list of non-negative integers",
        )
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_count(o) for o in offsets)):
        _fail(
            label, f"tensor {show_value(name)} has data_offsets {show_value(offsets)}; expected [begin, end]"
        )
    begin, end = offsets
    expected = math.prod(shape) * DTYPE_BYTES[dtype]
    if end < begin or end - begin != expected:
        _fail(
            label,
            f"tensor {show_value(name)} spans {end - begin} bytes, but {dtype} {shape} needs {expected}",
        )
    return tuple(shape), begin, end


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _no_duplicates(pairs: list[tuple[str, object]]) -> dict:
    found = dict(pairs)
    if len(found) != len(pairs):
        repeated = [key for key, count in Counter(key for key, _ in pairs).items() if count > 1]
        raise ValueError(f"duplicate keys {show_value(sorted(repeated))}")
    return found


def _fail(label: str, why: str):
    raise AdapterError("bad_weights", f"{label} is not a valid safetensors file: {why}")
