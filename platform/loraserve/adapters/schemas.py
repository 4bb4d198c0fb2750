"""Response bodies of the adapter API (frozen msgspec Structs, encoded as JSON by Litestar)."""

from __future__ import annotations

from typing import Literal

import msgspec
from msgspec import UNSET, UnsetType

from adapters_store import AdapterRecord


class Adapter(msgspec.Struct, frozen=True, kw_only=True):
    """One stored adapter version, as docs/API_ADMIN.md lists its fields."""

    name: str
    version: int
    rank: int
    alpha: float
    target_modules: list[str]
    base_model: str | None
    sha256: str  # of adapter_model.safetensors
    size_bytes: int
    created_at: str  # ISO 8601 UTC
    # The parser tool_choice "auto" uses for this adapter (the upload's tool_call_parser); absent: the server's
    tool_call_parser: str | UnsetType = UNSET
    format: str = "lora"  # "lora" or "dora" (use_dora)
    # The adapter's own embedding / LM head: {"lm_head": "modules_to_save" | "lora" | "saved", ...}
    vocab_modules: dict[str, str] = {}
    object: Literal["adapter"] = "adapter"

    @classmethod
    def from_record(cls, record: AdapterRecord) -> Adapter:
        return cls(**record.to_dict())


class AdapterList(msgspec.Struct, frozen=True, kw_only=True):
    """The tenant's adapters, the latest version of each, sorted by name (OpenAI's list shape)."""

    data: list[Adapter]
    object: Literal["list"] = "list"


class AdapterDetail(msgspec.Struct, frozen=True, kw_only=True):
    """One adapter: its latest version's record plus every committed version, oldest first."""

    name: str
    latest: Adapter
    versions: list[Adapter]
    object: Literal["adapter.detail"] = "adapter.detail"


class AdapterDeleted(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    versions: list[int]  # the versions deleted by this call
    deleted: bool = True
    object: Literal["adapter.deleted"] = "adapter.deleted"
