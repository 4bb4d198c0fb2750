"""Which projections of which layers PEFT wraps with LoRA for a config, read as PEFT reads it.

PEFT builds LoRA modules only where target_modules, exclude_modules, layers_to_transform and layers_pattern
say (peft.tuners.tuners_utils.check_target_module_exists), then loads the tensors into them: a tensor for a
module it did not wrap is dropped with a warning. The engine applies every tensor it is given, so a tensor
PEFT would drop is refused (naming the key that leaves it out) instead of being served differently.
A wrapped module without tensors is not an error (PEFT leaves it as initialised).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import regex

from adapter_format.errors import AdapterError, show_value
from adapter_format.files import CONFIG_FILE
from adapter_format.model_shape import module_key
from adapter_format.module_patterns import compile_pattern, search

MAX_LAYER_ENTRIES = 4096
MAX_NAMES, MAX_NAME_CHARS = 64, 256
ALL_LINEAR = "all-linear"  # PEFT's wildcard: every linear layer but the output head, so every projection here
# PEFT's layer index without layers_pattern: the first numbered path segment (`model.layers.3.` -> 3).
_DEFAULT_LAYER_INDEX = regex.compile(r".*?\.[^.]*\.(?P<idx>\d+)\.")
_LAYER_INDEX_AFTER = r"(?:^|.*?\.){}\.(?P<idx>\d+)\."  # PEFT's, around each layers_pattern entry


@dataclass(frozen=True)
class ModuleNames:
    """A target_modules or exclude_modules value: a regex matching whole names, or names matching as
    dotted suffixes."""

    field: str
    names: tuple[str, ...] = ()
    pattern: regex.Pattern | None = None

    def matches(self, key: str, deadline: float) -> bool:
        if self.pattern is not None:
            return search(self.pattern, key, deadline, self.field, how="fullmatch") is not None
        return any(key == name or key.endswith(f".{name}") for name in self.names)


@dataclass(frozen=True)
class Targets:
    """What a config targets; `refusal` answers for one (layer, projection) of the tensors."""

    target_modules: ModuleNames | None  # None: every projection (absent, or PEFT's "all-linear")
    exclude_modules: ModuleNames | None
    layers: frozenset[int] | None  # layers_to_transform; None: every layer
    layer_patterns: tuple[regex.Pattern, ...] = ()  # layers_pattern: where PEFT reads the layer index

    def names_vocab(self, key: str, deadline: float) -> bool:
        """Whether PEFT wraps embed_tokens or lm_head (`key`: its module name) with LoRA: only when
        target_modules names it (all-linear leaves the output layer out), nothing excludes it, and no
        layers_to_transform asks for a layer index, which these modules have none of."""
        if self.target_modules is None or not self.target_modules.matches(key, deadline):
            return False
        excluded = self.exclude_modules is not None and self.exclude_modules.matches(key, deadline)
        return not excluded and self.layers is None

    def refusal(
        self, layer: int, module: str, deadline: float, key: str | None = None
    ) -> tuple[str, str] | None:
        """(config key, why) if PEFT would not wrap this projection of this layer; None if it would.
        `key`: the module's full name where it is not `module_key(layer, module)` (one expert's part)."""
        key = key or module_key(layer, module)
        if self.exclude_modules is not None and self.exclude_modules.matches(key, deadline):
            return "exclude_modules", "exclude_modules names it"
        if self.target_modules is not None and not self.target_modules.matches(key, deadline):
            return "target_modules", "target_modules does not name it"
        if self.layers is None:
            return None
        index = None
        for pattern in self.layer_patterns or (_DEFAULT_LAYER_INDEX,):
            match = search(pattern, key, deadline, "layers_pattern")
            if match is not None:
                index = int(match["idx"])
                break
        if index is None:
            return "layers_pattern", "layers_pattern finds no layer index in its name (model.layers.N)"
        if index not in self.layers:
            return (
                "layers_to_transform",
                f"layers_to_transform {show_value(sorted(self.layers))} leaves it out",
            )
        return None


def read_targets(config: Mapping, target_modules: str | tuple[str, ...] | None) -> Targets:
    """Targets of a config whose target_modules was checked already; AdapterError naming the key at fault."""
    exclude = _names_value(config, "exclude_modules")
    layers = _layers(config.get("layers_to_transform"))
    patterns = _names_value(config, "layers_pattern")
    patterns = (patterns,) if isinstance(patterns, str) else patterns or ()
    if isinstance(target_modules, str) and (layers is not None or patterns):
        key = "layers_to_transform" if layers is not None else "layers_pattern"
        raise _bad(key, "cannot be used when target_modules is a regex string (PEFT refuses this config)")
    if patterns and layers is None:
        raise _bad("layers_pattern", "needs layers_to_transform as well (PEFT refuses this config)")
    return Targets(
        target_modules=None
        if target_modules in (None, ALL_LINEAR)
        else _module_names(target_modules, "target_modules"),
        exclude_modules=None if exclude is None else _module_names(exclude, "exclude_modules"),
        layers=layers,
        layer_patterns=tuple(compile_pattern(p, "layers_pattern", _LAYER_INDEX_AFTER) for p in patterns),
    )


def _module_names(value: str | tuple[str, ...], field: str) -> ModuleNames:
    if isinstance(value, str):
        return ModuleNames(field, pattern=compile_pattern(value, field))
    return ModuleNames(field, names=value)


def _layers(value: object) -> frozenset[int] | None:
    """layers_to_transform: an index, a list of indices, or null / [] (every layer, as PEFT reads it)."""
    if value is None or value == []:
        return None
    if _is_index(value):
        return frozenset([value])
    if isinstance(value, list) and len(value) <= MAX_LAYER_ENTRIES and all(_is_index(v) for v in value):
        return frozenset(value)
    raise _bad(
        "layers_to_transform",
        f"must be a layer index or a list of at most {MAX_LAYER_ENTRIES} indices (got {show_value(value)})",
    )


def _names_value(config: Mapping, key: str) -> str | tuple[str, ...] | None:
    """A string or a list of strings; null, "" and [] mean none, as PEFT reads them."""
    value = config.get(key)
    if value is None or value == [] or value == "":
        return None
    if isinstance(value, str) and len(value) <= MAX_NAME_CHARS:
        return value
    if (
        isinstance(value, list)
        and len(value) <= MAX_NAMES
        and all(isinstance(v, str) and 0 < len(v) <= MAX_NAME_CHARS for v in value)
    ):
        return tuple(value)
    raise _bad(
        key,
        f"must be a string or a list of at most {MAX_NAMES} strings of {MAX_NAME_CHARS} characters "
        f"(got {show_value(value)})",
    )


def _is_index(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 20


def _bad(field: str, what: str) -> AdapterError:
    return AdapterError("bad_config", f"{CONFIG_FILE}: {field} {what}", field)
