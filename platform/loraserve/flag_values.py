"""What `loraserve serve`'s flags and LORASERVE_* variables say, read from their text: `--lora-modules`
entries and byte sizes (loraserve.settings names these parsers in its fields)."""

from __future__ import annotations

import argparse
import json

from adapters_store.config import parse_size


def parse_size_flag(raw: str) -> int:
    """`10GiB`, `500MiB` or bytes."""
    try:
        return parse_size(raw)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


class LoraModule(tuple):
    """`(name, path)` of one `--lora-modules` entry; `base_model_name` is what vLLM's JSON form may add (the
    server refuses to start when it names another model)."""

    base_model_name: str | None

    def __new__(cls, name: str, path: str, base_model_name: str | None = None) -> LoraModule:
        module = super().__new__(cls, (name, path))
        module.base_model_name = base_model_name
        return module


def parse_lora_module(spec: str) -> LoraModule:
    """`NAME=PATH`, or vLLM's JSON `{"name": ..., "path": ..., "base_model_name": ...}`; ValueError naming the
    expected forms otherwise."""
    if spec.lstrip().startswith("{"):
        return _parse_json_module(spec)
    name, sep, path = spec.partition("=")
    if not sep or not name or not path:
        raise ValueError(
            f"--lora-modules expects NAME=PATH or a JSON object with name and path (got {spec!r})"
        )
    return LoraModule(name.strip(), path.strip())


def _parse_json_module(spec: str) -> LoraModule:
    try:
        fields = json.loads(spec)
    except ValueError:
        raise ValueError(f"--lora-modules: {spec!r} is not valid JSON") from None
    known = {"name", "path", "base_model_name"}
    if not isinstance(fields, dict) or not {"name", "path"} <= set(fields) or set(fields) - known:
        raise ValueError(
            f"--lora-modules JSON takes name, path and optionally base_model_name (got {spec!r})"
        )
    if not all(isinstance(v, str) and v for v in fields.values()):
        raise ValueError(f"--lora-modules JSON values must be non-empty strings (got {spec!r})")
    return LoraModule(fields["name"], fields["path"], fields.get("base_model_name"))
