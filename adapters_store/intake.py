"""Turn an upload, in any of its forms, into a staging folder holding exactly the two adapter files.

Everything is copied into staging (never validated in place), so what was checked is what gets
stored, and every byte is counted against the limits while it arrives. Each file goes through its
writer (file_writers.py), which checks the config and the weights' header before the weights' data is
written. An upload already written into a staging folder as it arrived (`Staged`, the HTTP path) is
taken in place: one copy on disk at most, never two.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from adapter_format.files import CONFIG_FILE, WEIGHTS_FILE
from adapter_format.model_shape import ModelShape
from adapters_store.archive import unpack_archive
from adapters_store.config import StoreConfig, format_bytes
from adapters_store.errors import InvalidAdapter, UploadTooLarge
from adapters_store.file_writers import copy_through, open_writer
from adapters_store.filenames import CONFIG, IGNORED, WEIGHTS, classify
from adapters_store.streams import CHUNK_BYTES, Source, copy_bounded, open_source

_ARCHIVE_FILE = "upload.archive"


@dataclass(frozen=True)
class AdapterFiles:
    """The two files of a PEFT adapter, each a path, bytes or binary stream (e.g. two multipart parts)."""

    config: Source
    weights: Source

    @classmethod
    def from_named(cls, files: Mapping[str, Source]) -> AdapterFiles:
        """Pick the two files out of uploaded `filename -> source` pairs, refusing pickles and strays.

        This is where an `adapter_model.bin` sent instead of the safetensors file is caught by name;
        a pickle renamed to .safetensors is caught later, by its header.
        """
        found: dict[str, Source] = {}
        for filename, source in files.items():
            kind = classify(filename)
            if kind == IGNORED:
                continue
            if kind in found:
                raise InvalidAdapter(f"two uploaded files are named {Path(filename).name}", "bad_upload")
            found[kind] = source
        if CONFIG not in found:
            raise InvalidAdapter(
                f"the upload has no {CONFIG_FILE}; send both adapter files", "missing_config"
            )
        if WEIGHTS not in found:
            raise InvalidAdapter(
                f"the upload has no {WEIGHTS_FILE}; send both adapter files", "missing_weights"
            )
        return cls(config=found[CONFIG], weights=found[WEIGHTS])


@dataclass(frozen=True)
class Staged:
    """An upload written into a staging folder (AdapterStore.staging) as it arrived: `folder` holding the
    adapter files it sent, or `archive`, the archive it sent, unpacked beside it and then removed."""

    folder: Path | None = None
    archive: Path | None = None


# AdapterFiles; a folder path; an archive path; an archive as bytes or a binary stream; or Staged.
UploadSource = AdapterFiles | str | os.PathLike | bytes | BinaryIO | Staged


def stage_upload(
    source: UploadSource, staging: Path, config: StoreConfig, shape: ModelShape | None = None
) -> Path:
    """Copy or unpack `source` into `staging` (an empty folder); returns the folder with the adapter files.
    With `shape`, the weights' header is checked against the base model before their data is written."""
    if isinstance(source, Staged):
        if source.folder is not None:
            return source.folder
        folder = source.archive.parent / "adapter"
        folder.mkdir(exist_ok=True)  # UploadIntake makes it (empty when an archive was sent)
        unpack_archive(source.archive, folder, config, shape)
        source.archive.unlink()  # the adapter files are all that stays on disk
        return folder
    folder = staging / "adapter"
    folder.mkdir()
    if isinstance(source, AdapterFiles):
        _copy_file(source.config, folder, CONFIG_FILE, config, shape)
        _copy_file(source.weights, folder, WEIGHTS_FILE, config, shape)
    elif isinstance(source, (str, os.PathLike)) and Path(source).is_dir():
        _copy_folder(Path(source), folder, config, shape)
    elif isinstance(source, (str, os.PathLike)):
        # An archive already on this disk (e.g. the HTTP layer's spooled part) unpacks in place: the
        # unpacking copies out only the adapter files and counts every byte it copies.
        path = Path(source)
        if not path.is_file():  # the path is the caller's own: no server path to hide
            raise InvalidAdapter(
                f"{path} does not exist; give an adapter folder, a .tar.gz or a .zip", "not_found"
            )
        if path.stat().st_size > config.max_archive_bytes:
            raise UploadTooLarge(
                f"the archive is larger than {format_bytes(config.max_archive_bytes)} (the max_archive_bytes limit)",
                "archive_too_large",
            )
        unpack_archive(path, folder, config, shape)
    else:
        archive = _spool(source, staging, config)
        unpack_archive(archive, folder, config, shape)
        archive.unlink()
    return folder


def _copy_file(
    source: Source, folder: Path, filename: str, config: StoreConfig, shape: ModelShape | None
) -> None:
    writer = open_writer(filename, folder, config, shape)
    try:
        with open_source(source) as src:
            copy_through(src, writer, CHUNK_BYTES)
    finally:
        writer.abort()


def _copy_folder(source: Path, folder: Path, config: StoreConfig, shape: ModelShape | None) -> None:
    """A PEFT folder on this machine (e.g. --lora-modules); symlinks are followed (Hub caches use them).
    The config is copied first, so the weights' header is checked against it before their data is."""
    entries = sorted(source.iterdir(), key=lambda entry: entry.name != CONFIG_FILE)
    for entry in entries:
        if entry.is_file() and classify(entry.name) != IGNORED:
            _copy_file(entry, folder, entry.name, config, shape)


def _spool(source: Source, staging: Path, config: StoreConfig) -> Path:
    """Archive bytes into one staging file, refused past max_archive_bytes while they stream."""
    path = staging / _ARCHIVE_FILE
    with open_source(source) as src, open(path, "wb") as out:
        copy_bounded(
            src, out, config.max_archive_bytes, "the archive", "max_archive_bytes", "archive_too_large"
        )
    return path
