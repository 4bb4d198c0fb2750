"""Bounded copies and hashing: uploads are counted as they stream, never held whole in memory."""

from __future__ import annotations

import hashlib
import io
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

from adapters_store.config import format_bytes
from adapters_store.errors import UploadTooLarge

CHUNK_BYTES = 1 << 20

# One uploaded file: a path on this machine, the bytes themselves, or a readable binary stream
# (read from its current position; the caller keeps ownership and closes it).
Source = str | os.PathLike | bytes | BinaryIO


@contextmanager
def open_source(source: Source) -> Iterator[BinaryIO]:
    if isinstance(source, (bytes, bytearray, memoryview)):
        yield io.BytesIO(bytes(source))
    elif isinstance(source, (str, os.PathLike)):
        with open(source, "rb") as f:
            yield f
    elif hasattr(source, "read"):
        yield source
    else:
        raise TypeError(f"an upload must be a path, bytes or a binary stream (got {type(source).__name__})")


def copy_bounded(src: BinaryIO, dst: BinaryIO, limit: int, what: str, setting: str, code: str) -> int:
    """Copy src to dst, refusing once more than `limit` bytes arrive (reads at most one chunk past it)."""
    total = 0
    while True:
        chunk = src.read(min(CHUNK_BYTES, limit + 1 - total))
        if not chunk:
            return total
        total += len(chunk)
        if total > limit:
            raise UploadTooLarge(
                f"{what} is larger than {format_bytes(limit)} (the {setting} limit); upload a smaller file "
                f"or raise {setting}",
                code,
            )
        dst.write(chunk)


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def fsync_path(path: Path) -> None:
    """Flush a file or directory entry to disk, so a crash cannot leave a renamed-but-empty file."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
