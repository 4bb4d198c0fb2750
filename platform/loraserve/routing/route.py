"""A/B route records and adapter references (`name` or `name@version`, adapter_format/names.py).

A Route belongs to one tenant (the config store keys it by tenant; the record itself does not repeat
it, so the API can return it as is). Variant order matters: the router lays the weights out as
consecutive ranges in this order (see routing/hashing.py), so reordering variants reshuffles users.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from adapter_format.names import format_ref, parse_ref, split_tenant
from loraserve.merges.fields import MergedAdapters

Sticky = Literal["user", "none"]
STICKY_MODES: tuple[str, ...] = ("user", "none")


class Variant(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One adapter, or a merge of several (`merge`, as a request's merged_adapters): exactly one of the two."""

    adapter: str | None = None  # "name" (the latest version when served) or "name@version"
    weight: int  # positive; only ratios matter (90/10 routes exactly like 9/1)
    merge: MergedAdapters | None = None

    @property
    def label(self) -> str:
        """How responses, metrics and errors name the variant: its adapter, or `merge:a+b@2` for a merge."""
        if self.merge is None:
            return self.adapter or ""
        return "merge:" + "+".join(self.merge.ids)

    @property
    def adapter_refs(self) -> tuple[str, ...]:
        """The adapter references (`name`, `name@2`) the variant needs."""
        if self.merge is None:
            return (self.adapter,) if self.adapter else ()
        return tuple(split_tenant(ref)[1] for ref in self.merge.ids)


class Route(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    variants: tuple[Variant, ...]
    sticky: Sticky = "user"

    @property
    def total_weight(self) -> int:
        return sum(variant.weight for variant in self.variants)


class AdapterRef(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    version: int | None = None  # None: the latest version at serving time

    def __str__(self) -> str:
        return format_ref(self.name, self.version)


def parse_adapter_ref(ref: object) -> AdapterRef:
    """`"a"` -> AdapterRef(name="a"); `"a@2"` -> AdapterRef(name="a", version=2); InvalidName otherwise."""
    name, version = parse_ref(ref)
    return AdapterRef(name=name, version=version)
