"""The two adapter files written as they arrive (an HTTP upload, an archive member, a local file), each
checked as early as its bytes allow: every upload form goes through these writers.

adapter_config.json is small (at most MAX_CONFIG_BYTES): it is collected in memory and written (its content
is checked with the weights' header, or with the whole adapter once every file is in, so an archive's
layout errors still come first). adapter_model.safetensors' header is checked before one byte of its tensor
data is written:

The first 8 bytes give the header's length, the next ones the header: both are held in memory (at most
MAX_HEADER_BYTES) and checked as soon as they are complete, with the same rules as a file on disk
(safetensors_header.py) and, when the adapter's config arrived first, against the config and the base
model too (`check_shapes`). A bad header is refused there: the data that follows is never written, so a
100 MiB file with a bad header costs a few bytes of disk, not 100 MiB. Then the data is written as it
streams, refused past the size limit and past the size the header declares; `close` refuses a file that
ends early.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from adapter_format.checkpoint import check_adapter
from adapter_format.errors import AdapterError
from adapter_format.files import CONFIG_FILE, WEIGHTS_FILE
from adapter_format.model_shape import ModelShape
from adapter_format.peft_config import MAX_CONFIG_BYTES, parse_adapter_config
from adapter_format.safetensors_header import header_length, parse_header
from adapters_store.config import StoreConfig, format_bytes
from adapters_store.disk_space import disk_full_is_an_error
from adapters_store.errors import InvalidAdapter, UploadTooLarge

ShapeCheck = Callable[[dict[str, tuple[int, ...]]], None]  # raises AdapterError for shapes it refuses


class ConfigWriter:
    """adapter_config.json: collected in memory (bounded) and written at `close`."""

    def __init__(self, dest: Path, label: str = CONFIG_FILE):
        self.dest = dest
        self.limit = MAX_CONFIG_BYTES
        self.label = label
        self._data = bytearray()

    @property
    def received(self) -> int:
        return len(self._data)

    def write(self, chunk: bytes) -> None:
        if len(self._data) + len(chunk) > self.limit:
            raise UploadTooLarge(
                f"{self.label} is larger than {format_bytes(self.limit)} (the adapter_config.json size limit)",
                "upload_too_large",
            )
        self._data += chunk

    def close(self) -> int:
        with disk_full_is_an_error("the upload"):
            self.dest.write_bytes(self._data)
        return len(self._data)

    def abort(self) -> None:
        self._data = bytearray()


class WeightsWriter:
    """Push the file's bytes in order with `write`, then `close`; InvalidAdapter or UploadTooLarge as soon
    as the bytes so far show the file must be refused (the caller removes `dest`)."""

    def __init__(
        self, dest: Path, limit: int, check_shapes: ShapeCheck | None = None, label: str = WEIGHTS_FILE
    ):
        self.dest = dest
        self.limit = limit
        self.label = label
        self._check_shapes = check_shapes
        self._head = bytearray()  # the 8-byte length, then the header, until checked
        self._header_len: int | None = None
        self._out: BinaryIO | None = None
        self._size = 0  # bytes received
        self._expected_size: int | None = None  # once the header is checked: the whole file's size

    @property
    def received(self) -> int:
        return self._size

    def write(self, chunk: bytes) -> None:
        self._size += len(chunk)
        if self._size > self.limit:
            raise UploadTooLarge(
                f"{self.label} is larger than {format_bytes(self.limit)} (the max_adapter_bytes limit); upload a "
                "smaller file or raise max_adapter_bytes",
                "upload_too_large",
            )
        if self._out is None:
            try:
                chunk = self._take_header(chunk)
            except AdapterError as exc:
                raise InvalidAdapter.from_adapter_error(exc) from None
            if self._out is None:
                return
        if self._expected_size is not None and self._size > self._expected_size:
            self._refuse(f"it holds more than the {self._expected_size} bytes its header describes (padded)")
        if chunk:
            with disk_full_is_an_error("the upload"):
                self._out.write(chunk)

    def close(self) -> int:
        """Finish the file; returns its size. Refuses a file that ended before its header or its data did."""
        if self._out is None:
            if self._header_len is None:
                self._refuse(f"it is {self._size} bytes, too short for a safetensors header")
            self._refuse(f"it ends inside its {self._header_len}-byte header (truncated)")
        with disk_full_is_an_error("the upload"):
            self._out.close()
        if self._size != self._expected_size:
            self._refuse(
                f"it holds {self._size} bytes, but its header describes {self._expected_size} (truncated)"
            )
        return self._size

    def abort(self) -> None:
        """Close without checks (the caller removes the staging folder)."""
        if self._out is not None and not self._out.closed:
            self._out.close()

    def _take_header(self, chunk: bytes) -> bytes:
        """Collect the header from the stream; once complete, check it and open the file. Returns the rest
        of `chunk` (tensor data) when the header ended inside it."""
        self._head += chunk
        if self._header_len is None:
            if len(self._head) < 8:
                return b""
            self._header_len = header_length(bytes(self._head[:8]), self.label)
        end = 8 + self._header_len
        if len(self._head) < end:
            return b""
        head, raw, rest = bytes(self._head[:8]), bytes(self._head[8:end]), bytes(self._head[end:])
        spans, data_size = parse_header(raw, head, self.label)
        if self._check_shapes is not None:
            self._check_shapes({name: span.shape for name, span in spans.items()})
        self._expected_size = end + data_size
        if self._expected_size > self.limit:
            raise UploadTooLarge(
                f"{self.label}'s header describes {self._expected_size} bytes, more than "
                f"{format_bytes(self.limit)} (the max_adapter_bytes limit)",
                "upload_too_large",
            )
        self._head = bytearray()
        with disk_full_is_an_error("the upload"):
            self._out = open(self.dest, "wb")
            self._out.write(head + raw)
        return rest

    def _refuse(self, why: str):
        raise InvalidAdapter(f"{self.label} is not a valid safetensors file: {why}", "bad_weights")


FileWriter = ConfigWriter | WeightsWriter


def open_writer(filename: str, folder: Path, config: StoreConfig, shape: ModelShape | None) -> FileWriter:
    """The writer of one adapter file (CONFIG_FILE or WEIGHTS_FILE) into `folder`. The weights' header is
    checked against the config and the base model too when the config is in `folder` already."""
    if filename == CONFIG_FILE:
        return ConfigWriter(folder / CONFIG_FILE)
    check_shapes = None
    if shape is not None and (folder / CONFIG_FILE).is_file():
        config_bytes = (folder / CONFIG_FILE).read_bytes()

        def check_shapes(shapes: dict[str, tuple[int, ...]]) -> None:  # config errors come first
            check_adapter(
                parse_adapter_config(config_bytes),
                shapes,
                shape,
                config.max_lora_rank,
                config.vocab_modules_served,
            )

    return WeightsWriter(folder / WEIGHTS_FILE, config.max_adapter_bytes, check_shapes)


def copy_through(src: BinaryIO, writer: FileWriter, chunk_bytes: int) -> int:
    """Feed a readable stream through `writer`, reading at most one chunk past its limit."""
    while chunk := src.read(min(chunk_bytes, writer.limit + 1 - writer.received)):
        writer.write(chunk)
    return writer.close()
