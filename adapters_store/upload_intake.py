"""An upload's files written into its staging folder as they arrive, part by part (push), for servers that
receive them as a stream (the HTTP form's parts).

Each `files` part goes through its writer (file_writers.py) straight into the staging folder: nothing is
spooled first and copied after, so an upload costs one copy on disk at most, and a weights file whose
header is bad (or, when the config came first, does not fit the config or the base model) is refused before
its data is written. An `archive` part is spooled once into the staging folder, its first bytes checked to
be a .tar.gz or .zip, and unpacked by the store (file_writers again, member by member), which then
removes it. The caller removes the staging folder (AdapterStore.staging) whatever happens.
"""

from __future__ import annotations

from pathlib import Path
from typing import BinaryIO

from adapter_format.files import CONFIG_FILE, WEIGHTS_FILE
from adapter_format.model_shape import ModelShape
from adapters_store.config import StoreConfig, format_bytes
from adapters_store.disk_space import disk_full_is_an_error
from adapters_store.errors import InvalidAdapter, UploadTooLarge
from adapters_store.file_writers import FileWriter, open_writer
from adapters_store.filenames import CONFIG, IGNORED, WEIGHTS, classify
from adapters_store.intake import Staged

ARCHIVE_FILE = "upload.archive"
_ARCHIVE_MAGICS = (b"\x1f\x8b", b"PK\x03\x04", b"PK\x05\x06")  # gzip; zip (an empty zip starts at its end)
_ARCHIVE_HOW = "pack the adapter folder with `tar czf adapter.tar.gz DIR` or `zip -r adapter.zip DIR`"


class _Discard:
    """A part whose bytes are not kept (README.md and the like)."""

    limit = 1 << 62
    received = 0

    def write(self, chunk: bytes) -> None:
        pass

    def close(self) -> int:
        return 0

    def abort(self) -> None:
        pass


class _ArchiveSpool:
    """The archive part: its magic checked on the first bytes, then written, bounded by max_archive_bytes."""

    def __init__(self, dest: Path, config: StoreConfig):
        self.dest = dest
        self.limit = config.max_archive_bytes
        self.received = 0
        self._head = b""
        self._out: BinaryIO | None = None

    def write(self, chunk: bytes) -> None:
        self.received += len(chunk)
        if self.received > self.limit:
            raise UploadTooLarge(
                f"the archive is larger than {format_bytes(self.limit)} (the max_archive_bytes limit)",
                "archive_too_large",
            )
        if self._out is None:
            self._head += chunk
            if len(self._head) < 4:
                return
            if not self._head.startswith(_ARCHIVE_MAGICS):
                raise _not_an_archive()
            chunk, self._head = self._head, b""
            with disk_full_is_an_error("the upload"):
                self._out = open(self.dest, "wb")
        with disk_full_is_an_error("the upload"):
            self._out.write(chunk)

    def close(self) -> int:
        if self._out is None:
            raise _not_an_archive()
        with disk_full_is_an_error("the upload"):
            self._out.close()
        return self.received

    def abort(self) -> None:
        if self._out is not None and not self._out.closed:
            self._out.close()


def _not_an_archive() -> InvalidAdapter:
    return InvalidAdapter(
        f"the archive is neither a .tar.gz nor a .zip; {_ARCHIVE_HOW}", "unsupported_archive"
    )


class UploadIntake:
    """Receive one upload: `open_file(filename)` or `open_archive()`, `write(chunk)`s, `close_part()`, for each
    part in order; then `source()` for AdapterStore.put. Raises InvalidAdapter, UploadTooLarge or DiskFull
    as soon as the bytes so far show the upload must be refused."""

    def __init__(self, staging: Path, config: StoreConfig, shape: ModelShape | None):
        self.folder = staging / "adapter"
        with disk_full_is_an_error("the upload"):
            self.folder.mkdir()
        self._archive_path = staging / ARCHIVE_FILE
        self._config = config
        self._shape = shape
        self._kinds: set[str] = set()
        self._part: FileWriter | _ArchiveSpool | _Discard | None = None

    def open_file(self, filename: str) -> None:
        """A part holding one of the adapter's files, by its name (refused names raise here)."""
        kind = classify(filename)
        if kind == IGNORED:
            self._part = _Discard()
            return
        if kind in self._kinds:
            raise InvalidAdapter(f"two uploaded files are named {Path(filename).name}", "bad_upload")
        self._kinds.add(kind)
        self._part = open_writer(
            CONFIG_FILE if kind == CONFIG else WEIGHTS_FILE, self.folder, self._config, self._shape
        )

    def open_archive(self) -> None:
        if self._kinds:
            raise InvalidAdapter("send either the adapter files or one archive, not both", "bad_upload")
        self._kinds.add("archive")
        self._part = _ArchiveSpool(self._archive_path, self._config)

    def write(self, chunk: bytes) -> None:
        self._part.write(chunk)

    def close_part(self) -> None:
        part, self._part = self._part, None
        part.close()

    def abort(self) -> None:
        if self._part is not None:
            self._part.abort()

    def source(self) -> Staged:
        """What the parts made, for `AdapterStore.put`; InvalidAdapter if an adapter file is missing."""
        if "archive" in self._kinds:
            return Staged(archive=self._archive_path)
        if CONFIG not in self._kinds:
            raise InvalidAdapter(
                f"the upload has no {CONFIG_FILE}; send both adapter files", "missing_config"
            )
        if WEIGHTS not in self._kinds:
            raise InvalidAdapter(
                f"the upload has no {WEIGHTS_FILE}; send both adapter files", "missing_weights"
            )
        return Staged(folder=self.folder)
