"""`merged_adapters`: several of the tenant's adapters merged into one, in a request or a route variant.

LoRAX's field and names: `{"ids": [...], "weights": [...], "merge_strategy": "ties", "density": 0.5,
"majority_sign_method": "total"}`. `weights` default to 1 each; `merge_strategy` to `linear`; `density`
is required by (and only accepted with) `ties`, `dare_linear` and `dare_ties`; `majority_sign_method`
(default `total`) only with `ties` and `dare_ties`. The methods are PEFT's `add_weighted_adapter`'s
(adapter_format/merge.py), plus PEFT's `cat`. Every rule a spec can break on its own is checked here,
with a message naming the field; what needs the adapters themselves (ranks, formats, base models) is
checked when the merge is computed (service.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from adapter_format.errors import InvalidName
from adapter_format.merge import (
    DENSITY_METHODS,
    MAJORITY_SIGN_METHODS,
    MERGE_METHODS,
    SIGN_METHODS,
    MergeMethod,
)
from adapter_format.names import split_tenant
from loraserve.merges.fields import MergedAdapters
from loraserve.routing.route import AdapterRef, parse_adapter_ref

MAX_MERGE_PARTS = 8  # adapters in one merge: each is read and merged into the new one
MAX_MERGE_WEIGHT = 1000.0  # |weight|; PEFT takes any, nothing useful is near this
EXAMPLE = '{"ids": ["a", "b@2"], "weights": [0.7, 0.3], "merge_strategy": "ties", "density": 0.5}'


class InvalidMerge(ValueError):
    """A spec that cannot be merged; `field` is the path at fault (e.g. `merged_adapters.density`)."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class MergeSpec:
    """A checked spec: each part's reference as written (`name`, `name@2` or `tenant/name`), its parsed
    form, its weight, and the method."""

    ids: tuple[str, ...]
    refs: tuple[AdapterRef, ...]
    weights: tuple[float, ...]
    method: MergeMethod

    def label(self, versions: tuple[str, ...] | None = None) -> str:
        """What the response's `model` says: `ties:a@1*0.7+b@2*0.3` (the resolved versions if given)."""
        names = versions or self.ids
        parts = "+".join(f"{n}*{format(w, 'g')}" for n, w in zip(names, self.weights))
        return f"{self.method.method}:{parts}"


def check_merge(merge: MergedAdapters, at: str = "merged_adapters") -> MergeSpec:
    """The spec checked and with its defaults; InvalidMerge naming the field otherwise."""
    ids = merge.ids
    if not 1 <= len(ids) <= MAX_MERGE_PARTS:
        raise InvalidMerge(
            f"{at}.ids must name 1 to {MAX_MERGE_PARTS} adapters (got {len(ids)}), e.g. {EXAMPLE}",
            f"{at}.ids",
        )
    refs: list[AdapterRef] = []
    for i, ref in enumerate(ids):
        bare = split_tenant(ref)[1]  # `tenant/name`: the tenant is checked at resolution
        try:
            parsed = parse_adapter_ref(bare)
        except InvalidName as exc:
            raise InvalidMerge(f"{at}.ids[{i}]: {exc}", f"{at}.ids[{i}]") from None
        if ref in ids[:i]:
            raise InvalidMerge(
                f"{at}.ids[{i}] {ref!r} is listed twice; list each adapter once", f"{at}.ids[{i}]"
            )
        refs.append(parsed)
    weights = merge.weights if merge.weights is not None else (1.0,) * len(ids)
    if len(weights) != len(ids):
        raise InvalidMerge(
            f"{at}.weights has {len(weights)} entries for {len(ids)} adapters in {at}.ids; give one weight per "
            "adapter (or none: 1 each)",
            f"{at}.weights",
        )
    for i, weight in enumerate(weights):
        if not math.isfinite(weight) or abs(weight) > MAX_MERGE_WEIGHT:
            raise InvalidMerge(
                f"{at}.weights[{i}] must be a finite number within +-{MAX_MERGE_WEIGHT:g} (got {weight!r})",
                f"{at}.weights[{i}]",
            )
    method = merge.merge_strategy
    if method not in MERGE_METHODS:
        raise InvalidMerge(
            f"{at}.merge_strategy {method!r} is not a merge method; use one of {', '.join(MERGE_METHODS)}",
            f"{at}.merge_strategy",
        )
    density = merge.density
    if method in DENSITY_METHODS:
        if density is None:
            raise InvalidMerge(
                f"{at}.density is required with merge_strategy {method!r}: the fraction of each adapter's "
                "weights kept, in (0, 1]",
                f"{at}.density",
            )
        if not 0 < density <= 1:
            raise InvalidMerge(f"{at}.density must be in (0, 1] (got {density!r})", f"{at}.density")
    elif density is not None:
        raise InvalidMerge(
            f"{at}.density applies to {', '.join(DENSITY_METHODS)} only, not {method!r}; remove it",
            f"{at}.density",
        )
    sign = merge.majority_sign_method
    if method in SIGN_METHODS:
        sign = "total" if sign is None else sign
        if sign not in MAJORITY_SIGN_METHODS:
            raise InvalidMerge(
                f"{at}.majority_sign_method must be one of {', '.join(MAJORITY_SIGN_METHODS)} (got {sign!r})",
                f"{at}.majority_sign_method",
            )
    elif sign is not None:
        raise InvalidMerge(
            f"{at}.majority_sign_method applies to {', '.join(SIGN_METHODS)} only, not {method!r}; remove it",
            f"{at}.majority_sign_method",
        )
    return MergeSpec(
        ids=tuple(ids),
        refs=tuple(refs),
        weights=tuple(float(w) for w in weights),
        method=MergeMethod(method, density, sign or "total"),
    )
