"""Which files an adapter upload may hold, whatever its form (two files, a folder or an archive).

Stored: adapter_config.json and adapter_model.safetensors, nothing else. Refused: pickled checkpoints
(`.bin`, `.pt`, ...; never unpickled) and any other file, each with a message saying what to do.
Dropped silently: the text files that `save_pretrained` and zip tools add (README.md, LICENSE,
.gitattributes, macOS `._*` and .DS_Store), so a plain archive of a PEFT folder uploads as is.
"""

from __future__ import annotations

from pathlib import PurePosixPath

from adapter_format.files import CONFIG_FILE, WEIGHTS_FILE
from adapters_store.errors import InvalidAdapter

MANIFEST_FILE = "manifest.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt", ".joblib")
_TEXT_SUFFIXES = (".md", ".txt", ".rst")
_IGNORED_NAMES = (".gitattributes", ".gitignore", ".DS_Store")

CONFIG, WEIGHTS, IGNORED = "config", "weights", "ignored"


def classify(filename: str) -> str:
    """CONFIG, WEIGHTS or IGNORED for a file's base name; InvalidAdapter for anything refused."""
    base = PurePosixPath(filename).name
    lower = base.lower()
    if base == CONFIG_FILE:
        return CONFIG
    if base == WEIGHTS_FILE:
        return WEIGHTS
    if lower.endswith(PICKLE_SUFFIXES):
        raise InvalidAdapter(
            f"{filename} is a pickled checkpoint; pickles are never loaded (they can run code). Save the adapter "
            f"with safetensors (save_pretrained(..., safe_serialization=True)) and upload {WEIGHTS_FILE}",
            "pickle_refused",
        )
    if (
        base in _IGNORED_NAMES
        or base.startswith("._")
        or lower.endswith(_TEXT_SUFFIXES)
        or lower.startswith("license")
    ):
        return IGNORED
    if lower.endswith(".safetensors"):
        raise InvalidAdapter(
            f"{filename}: the weights file must be named {WEIGHTS_FILE} (as PEFT's save_pretrained writes it)",
            "unexpected_file",
        )
    raise InvalidAdapter(
        f"unexpected file {filename}: an adapter upload holds only {CONFIG_FILE} and {WEIGHTS_FILE} "
        "(README, LICENSE and .txt/.md files are ignored); remove it and upload again",
        "unexpected_file",
    )


def is_junk_folder(part: str) -> bool:
    """Folders zip tools add beside the real content (macOS resource forks)."""
    return part == "__MACOSX"
