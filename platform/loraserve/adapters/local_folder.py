"""The adapter files of a folder on this machine, opened for `POST /v1/load_lora_adapter` only where they
really lie under a folder the operator allowed (`--allowed-lora-paths`).

The caller names the folder, so everything in it is the caller's to arrange: a file may be a symlink to
anywhere (another tenant's adapter, a key file), a folder on the way may be swapped for a symlink after a
check, a "file" may be a FIFO that blocks a reader forever. So each adapter file is resolved, checked to
lie under an allowed folder, opened without following a last symlink and without blocking, checked to be
a regular file, and checked again through the descriptor itself (/proc/self/fd), which names the file
actually opened; the store then reads those descriptors. Messages name files by the caller's names only.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import BinaryIO

from adapters_store import AdapterFiles
from adapters_store.filenames import IGNORED, classify
from loraserve.errors import BadRequest

OUTSIDE = "is not under a folder this server allows loading from"


def contained(path: str | os.PathLike, roots: tuple[str, ...]) -> bool:
    """Whether the real path of `path` lies under the real path of one of `roots`."""
    real = Path(os.path.realpath(path))
    return any(real.is_relative_to(os.path.realpath(root)) for root in roots)


def open_adapter_files(
    folder: Path, roots: tuple[str, ...], lora_path: str
) -> tuple[AdapterFiles, list[BinaryIO]]:
    """AdapterFiles of the folder's two files as open streams, and the streams (the caller closes them).
    BadRequest for a file that leaves the allowed folders or is no regular file; InvalidAdapter (the
    store's rules) for refused names and missing files."""
    opened: dict[str, BinaryIO] = {}
    try:
        for entry in sorted(folder.iterdir()):
            if classify(entry.name) != IGNORED:  # refuses pickles and strays by name
                opened[entry.name] = _open_contained(entry, roots, lora_path)
        return AdapterFiles.from_named(opened), list(opened.values())
    except BaseException:
        for stream in opened.values():
            stream.close()
        raise


def _open_contained(entry: Path, roots: tuple[str, ...], lora_path: str) -> BinaryIO:
    where = f"{entry.name} in lora_path {lora_path!r}"
    real = os.path.realpath(entry)
    if not contained(real, roots):
        raise BadRequest(f"{where} links to a file that {OUTSIDE}", param="lora_path")
    try:
        fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        raise BadRequest(f"{where} cannot be read", param="lora_path") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise BadRequest(f"{where} is not a regular file", param="lora_path")
        opened = _path_of(fd)
        if opened is not None and not contained(opened, roots):  # a folder on the way changed since
            raise BadRequest(f"{where} links to a file that {OUTSIDE}", param="lora_path")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _path_of(fd: int) -> str | None:
    """The path of the file open as `fd` (Linux); None where the system does not say."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return None
