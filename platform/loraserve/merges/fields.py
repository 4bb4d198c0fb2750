"""The `merged_adapters` field as sent: a request body's `merged_adapters`, a route variant's `merge`."""

from __future__ import annotations

import msgspec


class MergedAdapters(
    msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, omit_defaults=True
):
    """LoRAX's names; the rules and defaults are loraserve.merges.spec's."""

    ids: tuple[str, ...]
    weights: tuple[float, ...] | None = None
    merge_strategy: str = "linear"
    density: float | None = None
    majority_sign_method: str | None = None
