"""Unpack an uploaded .tar.gz or .zip of a PEFT adapter folder, refusing anything unsafe.

Nothing is extracted by the archive libraries themselves: each member is checked (relative path,
no `..`, a regular file or a folder, no links or devices), counted against `max_archive_files`,
and only the two adapter files are copied out, with a running byte count, so a member whose header
lies or a "zip bomb" of zeros is stopped as soon as it passes the limits. Files may sit at the root
or in one top-level folder (`tar czf a.tgz my-adapter/`). The adapter files are written through their
writers (file_writers.py), so a weights member's header is checked before its data is written.
"""

from __future__ import annotations

import gzip
import re
import stat
import struct
import tarfile
import zipfile
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import BinaryIO

from adapter_format.model_shape import ModelShape
from adapters_store.config import StoreConfig, format_bytes
from adapters_store.errors import InvalidAdapter, UploadTooLarge
from adapters_store.file_writers import copy_through, open_writer
from adapters_store.filenames import IGNORED, classify, is_junk_folder
from adapters_store.streams import CHUNK_BYTES

_GZIP_MAGIC = b"\x1f\x8b"
# What the tar, gzip and zip readers raise on damaged input (gzip.BadGzipFile is an OSError, hence listed).
_CORRUPT = (tarfile.TarError, zipfile.BadZipFile, zlib.error, EOFError, gzip.BadGzipFile)
_ZIP_MAGICS = (b"PK\x03\x04", b"PK\x05\x06")
_DRIVE = re.compile(r"^[A-Za-z]:")
FILE, FOLDER = "file", "folder"
# A central-directory entry is 46 bytes plus its name, extra field and comment; real ones stay far below this.
_MAX_DIRECTORY_ENTRY_BYTES = 8 * 1024


@dataclass
class _Member:
    name: str
    kind: str  # FILE or FOLDER (anything else is refused while listing)
    size: int  # as the header claims; checked again while copying
    open: Callable[[], BinaryIO]


def unpack_archive(archive: Path, dest: Path, config: StoreConfig, shape: ModelShape | None = None) -> None:
    """Copy the adapter files of `archive` into `dest` (created by the caller)."""
    with open(archive, "rb") as f:
        magic = f.read(4)
    if magic[:2] != _GZIP_MAGIC and magic not in _ZIP_MAGICS:
        raise InvalidAdapter(
            "the archive is neither a .tar.gz nor a .zip; pack the adapter folder with "
            "`tar czf adapter.tar.gz DIR` or `zip -r adapter.zip DIR`",
            "unsupported_archive",
        )
    try:
        if magic[:2] == _GZIP_MAGIC:
            with _open_tar(archive) as tar:
                _extract(_tar_members(tar), dest, config, shape)
        else:
            _check_zip_entry_count(archive, config.max_archive_files)
            with _open_zip(archive) as zf:
                _extract(_zip_members(zf), dest, config, shape)
    except _CORRUPT as exc:  # raised while a member's data is read
        raise InvalidAdapter(f"the archive is corrupt: {exc}", "bad_archive") from None


def _extract(members: Iterator[_Member], dest: Path, config: StoreConfig, shape: ModelShape | None) -> None:
    num_members, total_bytes, top_folders = 0, 0, set()
    seen: set[str] = set()
    for member in members:
        num_members += 1
        if num_members > config.max_archive_files:
            raise UploadTooLarge(
                f"the archive holds more than {config.max_archive_files} entries (max_archive_files); "
                "an adapter archive needs only adapter_config.json and adapter_model.safetensors",
                "too_many_files",
            )
        parts = _safe_parts(member.name)
        if member.kind == FOLDER or not parts or is_junk_folder(parts[0]):
            continue
        total_bytes += member.size
        _check_total(total_bytes, config)
        if len(parts) > 2:
            raise InvalidAdapter(
                f"archive member {member.name!r} is nested too deep: put the adapter files at the archive's "
                "root or in one top-level folder",
                "bad_archive_layout",
            )
        top_folders.add(parts[0] if len(parts) == 2 else None)
        if len(top_folders) > 1:
            raise InvalidAdapter(
                "the archive holds more than one adapter folder (or files both at the root and in a folder); "
                "upload one adapter per archive",
                "bad_archive_layout",
            )
        kind = classify(member.name)
        if kind == IGNORED:
            continue
        if parts[-1] in seen:
            raise InvalidAdapter(f"archive member {parts[-1]} appears twice", "bad_archive_layout")
        seen.add(parts[-1])
        writer = open_writer(parts[-1], dest, config, shape)
        try:
            with member.open() as src:
                written = copy_through(src, writer, CHUNK_BYTES)
        finally:
            writer.abort()
        # The header's size may lie (zip); what was really written counts.
        total_bytes += written - member.size
        _check_total(total_bytes, config)


def _check_total(total_bytes: int, config: StoreConfig) -> None:
    if total_bytes > config.max_archive_bytes:
        raise UploadTooLarge(
            f"the archive unpacks to more than {format_bytes(config.max_archive_bytes)} (max_archive_bytes)",
            "archive_too_large",
        )


def _safe_parts(name: str) -> tuple[str, ...]:
    """A member's path as relative parts ('.' dropped); InvalidAdapter for absolute or escaping paths."""
    if "\x00" in name or "\\" in name:
        raise InvalidAdapter(f"archive member {name!r} has a NUL or backslash in its path", "unsafe_archive")
    if name.startswith("/") or _DRIVE.match(name):
        raise InvalidAdapter(
            f"archive member {name!r} has an absolute path; archives must hold relative paths",
            "unsafe_archive",
        )
    parts = tuple(p for p in PurePosixPath(name).parts if p not in ("", "."))
    if ".." in parts:
        raise InvalidAdapter(f"archive member {name!r} climbs out of the archive with '..'", "unsafe_archive")
    return parts


def _open_tar(archive: Path) -> tarfile.TarFile:
    try:
        return tarfile.open(archive, "r:gz")
    except (tarfile.TarError, OSError, EOFError) as exc:
        raise InvalidAdapter(f"the .tar.gz archive is corrupt: {exc}", "bad_archive") from None


def _tar_members(tar: tarfile.TarFile) -> Iterator[_Member]:
    try:
        for info in tar:
            if info.issym() or info.islnk():
                link = "symbolic link" if info.issym() else "hard link"
                raise InvalidAdapter(
                    f"archive member {info.name!r} is a {link} (to {info.linkname!r}); links are not allowed "
                    "in adapter archives, pack the files themselves",
                    "unsafe_archive",
                )
            if not (info.isreg() or info.isdir()):
                raise InvalidAdapter(
                    f"archive member {info.name!r} is a device, FIFO or other special file; only regular files "
                    "and folders are allowed",
                    "unsafe_archive",
                )
            kind = FILE if info.isreg() else FOLDER
            yield _Member(info.name, kind, info.size, lambda info=info: tar.extractfile(info))
    except (tarfile.TarError, OSError, EOFError) as exc:
        raise InvalidAdapter(f"the .tar.gz archive is corrupt: {exc}", "bad_archive") from None


def _open_zip(archive: Path) -> zipfile.ZipFile:
    try:
        return zipfile.ZipFile(archive)
    except (zipfile.BadZipFile, OSError, EOFError) as exc:
        raise InvalidAdapter(f"the .zip archive is corrupt: {exc}", "bad_archive") from None


def _zip_members(zf: zipfile.ZipFile) -> Iterator[_Member]:
    for info in zf.infolist():
        mode = info.external_attr >> 16
        file_type = stat.S_IFMT(mode)
        if stat.S_ISLNK(mode):
            raise InvalidAdapter(
                f"archive member {info.filename!r} is a symbolic link; links are not allowed in adapter archives, "
                "pack the files themselves",
                "unsafe_archive",
            )
        if file_type not in (0, stat.S_IFREG, stat.S_IFDIR):
            raise InvalidAdapter(
                f"archive member {info.filename!r} is a device, FIFO or other special file", "unsafe_archive"
            )
        if info.flag_bits & 0x1:
            raise InvalidAdapter(
                f"archive member {info.filename!r} is encrypted; upload it unencrypted", "bad_archive"
            )
        kind = FOLDER if info.is_dir() else FILE
        yield _Member(info.filename, kind, info.file_size, lambda info=info: _open_zip_member(zf, info))


def _open_zip_member(zf: zipfile.ZipFile, info: zipfile.ZipInfo) -> BinaryIO:
    try:
        return zf.open(info)
    except (zipfile.BadZipFile, NotImplementedError, OSError) as exc:
        raise InvalidAdapter(f"the .zip archive is corrupt: {exc}", "bad_archive") from None


def _check_zip_entry_count(archive: Path, max_entries: int) -> None:
    """Check the entry count and central-directory size from the end record, before zipfile reads it.

    zipfile builds one object per central-directory entry up front, so an archive of millions of
    tiny entries would cost gigabytes of memory before the first member could be counted. The size
    bound also covers an end record that understates the count.
    """
    with open(archive, "rb") as f:
        f.seek(0, 2)
        size = f.tell()
        tail_len = min(size, 22 + 0xFFFF)  # the record is 22 bytes plus a comment of at most 64 KiB
        f.seek(size - tail_len)
        tail = f.read(tail_len)
        at = tail.rfind(b"PK\x05\x06")
        if at < 0 or at + 22 > len(tail):
            raise InvalidAdapter(
                "the .zip archive is corrupt: no end-of-central-directory record", "bad_archive"
            )
        count, directory_bytes = struct.unpack("<HI", tail[at + 10 : at + 16])
        if count == 0xFFFF or directory_bytes == 0xFFFFFFFF:  # zip64: the real values are in the zip64 record
            locator = tail[at - 20 : at] if at >= 20 else b""
            if locator[:4] != b"PK\x06\x07":
                raise InvalidAdapter("the .zip archive is corrupt: bad zip64 locator", "bad_archive")
            (offset,) = struct.unpack("<Q", locator[8:16])
            f.seek(offset)
            record = f.read(56)
            if record[:4] != b"PK\x06\x06" or len(record) < 56:
                raise InvalidAdapter("the .zip archive is corrupt: bad zip64 end record", "bad_archive")
            count, directory_bytes = struct.unpack("<QQ", record[32:48])
    if count > max_entries or directory_bytes > max_entries * _MAX_DIRECTORY_ENTRY_BYTES:
        raise UploadTooLarge(
            f"the archive holds {count} entries ({directory_bytes} bytes of directory), more than "
            f"{max_entries} (max_archive_files); an adapter archive needs only adapter_config.json and "
            "adapter_model.safetensors",
            "too_many_files",
        )
