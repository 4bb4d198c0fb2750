"""The adapter record: what `manifest.json` holds and what the HTTP API returns for an adapter."""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone

from adapter_format.names import check_adapter_name, check_version, format_ref

_SHA256 = re.compile(r"[0-9a-f]{64}")
_PARSER = re.compile(r"[A-Za-z0-9_\-]{1,64}")
# A Hugging Face hub id: `name` or `owner/name` of letters, digits, `-`, `_` and `.`, starting with a
# letter or digit. Paths (`/abs`, `./rel`, `.loraserve/models/x`, `a/b/c`, `~/x`, `C:\x`) are not.
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]{0,95}(/[A-Za-z0-9][\w.-]{0,95})?")


def recorded_base_model(configured: str | None, served_model: str | None) -> str | None:
    """What an adapter's record says it was trained on: the adapter_config.json's
    base_model_name_or_path when that is a hub id (something a reader can look up), else the served
    base model's id (uploads are checked against its shapes); a local path on the trainer's machine
    says nothing to anyone else, so it is never recorded."""
    if configured is not None and _HUB_ID.fullmatch(configured) and ".." not in configured:
        return configured
    return served_model


@dataclass(frozen=True)
class AdapterRecord:
    """One committed adapter version. `sha256` and `size_bytes` describe adapter_model.safetensors."""

    name: str
    version: int
    rank: int  # the largest rank over its modules
    alpha: float  # lora_alpha of adapter_config.json
    target_modules: tuple[str, ...]
    base_model: str | None  # informative only (shapes are what is checked): see recorded_base_model
    sha256: str
    size_bytes: int
    created_at: str  # ISO 8601 UTC, e.g. 2025-01-31T12:00:00Z
    # The tool-call format the adapter writes (a parser name of the server's, e.g. "hermes"), given at
    # upload; left out of the manifest when None.
    tool_call_parser: str | None = None
    format: str = "lora"  # "lora" or "dora" (adapter_format.checkpoint.PeftAdapter.format)
    # The adapter's own embedding or LM head: {"lm_head": "modules_to_save", "embed_tokens": "lora", ...}
    # (PeftAdapter.vocab_formats); empty for adapters of the decoder projections only.
    vocab_modules: dict[str, str] = field(default_factory=dict)

    @property
    def ref(self) -> str:
        return format_ref(self.name, self.version)

    def to_dict(self) -> dict:
        data = asdict(self)
        data["target_modules"] = list(self.target_modules)
        if self.tool_call_parser is None:
            del data["tool_call_parser"]
        if not self.vocab_modules:  # manifests of decoder-only adapters stay as they were
            del data["vocab_modules"]
        return data

    def to_json(self) -> bytes:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True).encode() + b"\n"

    @classmethod
    def from_json(cls, data: bytes) -> AdapterRecord:
        """Parse a manifest; ValueError if it is not one. Unknown keys are ignored (forward compatibility)."""
        try:
            raw = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"manifest is not valid JSON: {exc}") from None
        if not isinstance(raw, dict):
            raise ValueError("manifest must be a JSON object")
        try:
            record = cls(
                name=check_adapter_name(raw["name"]),
                version=check_version(raw["version"]),
                rank=int(raw["rank"]),
                alpha=float(raw["alpha"]),
                target_modules=tuple(str(m) for m in raw["target_modules"]),
                base_model=None if raw.get("base_model") is None else str(raw["base_model"]),
                sha256=str(raw["sha256"]),
                size_bytes=int(raw["size_bytes"]),
                created_at=str(raw["created_at"]),
                tool_call_parser=_optional_parser(raw.get("tool_call_parser")),
                format=str(raw.get("format", "lora")),  # manifests written before formats were recorded
                vocab_modules={str(k): str(v) for k, v in (raw.get("vocab_modules") or {}).items()},
            )
        except (KeyError, TypeError) as exc:
            raise ValueError(f"manifest is missing or mistypes a field: {exc}") from None
        if not _SHA256.fullmatch(record.sha256):
            raise ValueError(f"manifest sha256 {record.sha256!r} is not 64 lowercase hex digits")
        return record


def check_parser_name(name: str) -> str:
    """A tool-call parser name as a record keeps it (the server checks that it knows the parser)."""
    if not isinstance(name, str) or not _PARSER.fullmatch(name):
        raise ValueError(f"tool_call_parser {name!r} must be 1-64 letters, digits, '_' or '-'")
    return name


def _optional_parser(value: object) -> str | None:
    return None if value is None else check_parser_name(value)  # type: ignore[arg-type]


def utc_now_iso() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
