"""Turn an upload, in any of its forms, into a staging folder holding exactly the two adapter files.

Everything is copied into staging (never validated in place), so what was checked is what gets
stored, and every byte is counted against the limits while it arrives.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from adapter_format.files import CONFIG_FILE, WEIGHTS_FILE
from adapter_format.peft_config import MAX_CONFIG_BYTES
from adapters_store.archive import unpack_archive
from adapters_store.config import StoreConfig, format_bytes
from adapters_store.errors import InvalidAdapter, UploadTooLarge
from adapters_store.filenames import CONFIG, IGNORED, WEIGHTS, classify
from adapters_store.streams import Source, copy_bounded, open_source

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


# AdapterFiles; a folder path; an archive path; or an archive as bytes or a binary stream.
UploadSource = AdapterFiles | str | os.PathLike | bytes | BinaryIO


def stage_upload(source: UploadSource, staging: Path, config: StoreConfig) -> Path:
    """Copy or unpack `source` into `staging` (an empty folder); returns the folder with the adapter files."""
    folder = staging / "adapter"
    folder.mkdir()
    if isinstance(source, AdapterFiles):
        _copy_file(source.config, folder / CONFIG_FILE, config)
        _copy_file(source.weights, folder / WEIGHTS_FILE, config)
    elif isinstance(source, (str, os.PathLike)) and Path(source).is_dir():
        _copy_folder(Path(source), folder, config)
    elif isinstance(source, (str, os.PathLike)):
        # An archive already on this disk (e.g. the HTTP layer's spooled part) unpacks in place: the
        # unpacking copies out only the adapter files and counts every byte it copies.
        path = Path(source)
        if not path.is_file():
            raise InvalidAdapter(
                f"{path} does not exist; give an adapter folder, a .tar.gz or a .zip", "not_found"
            )
        if path.stat().st_size > config.max_archive_bytes:
            raise UploadTooLarge(
                f"the archive is larger than {format_bytes(config.max_archive_bytes)} (the max_archive_bytes limit)",
                "archive_too_large",
            )
        unpack_archive(path, folder, config)
    else:
        unpack_archive(_spool(source, staging, config), folder, config)
    return folder


def _copy_file(source: Source, dest: Path, config: StoreConfig) -> None:
    if dest.name == CONFIG_FILE:
        limit, setting = MAX_CONFIG_BYTES, "adapter_config.json size"
    else:
        limit, setting = config.max_adapter_bytes, "max_adapter_bytes"
    with open_source(source) as src, open(dest, "wb") as out:
        copy_bounded(src, out, limit, dest.name, setting, "upload_too_large")


def _copy_folder(source: Path, folder: Path, config: StoreConfig) -> None:
    """A PEFT folder on this machine (e.g. --lora-modules); symlinks are followed (Hub caches use them)."""
    for entry in sorted(source.iterdir()):
        if entry.is_file() and classify(entry.name) != IGNORED:
            _copy_file(entry, folder / entry.name, config)


def _spool(source: Source, staging: Path, config: StoreConfig) -> Path:
    """Archive bytes into one staging file, refused past max_archive_bytes while they stream."""
    path = staging / _ARCHIVE_FILE
    with open_source(source) as src, open(path, "wb") as out:
        copy_bounded(
            src, out, config.max_archive_bytes, "the archive", "max_archive_bytes", "archive_too_large"
        )
    return path
