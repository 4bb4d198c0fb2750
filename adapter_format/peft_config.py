"""adapter_config.json: read with bounded nesting, every key the engine relies on checked for type and range.

The one place for these rules: the adapter store runs them on uploads (a 422 naming the field) and the
engine on every folder it loads (an AdapterError naming the field), so a config the store took is one
the engine serves. Keys the engine does not use (lora_dropout, task_type, ...) are not checked.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import regex

from adapter_format.bounded_json import loads_bounded
from adapter_format.errors import AdapterError, show_value
from adapter_format.files import CONFIG_FILE
from adapter_format.model_shape import ModelShape

# A PEFT config is a few hundred bytes, nested three levels at most (layer_replication's lists).
MAX_CONFIG_BYTES = 1 << 20
MAX_CONFIG_DEPTH = 8
# PEFT scales by alpha / r (or alpha / sqrt(r)); nothing trained has |alpha| near this, and an
# infinite or huge alpha turns every logit into NaN.
MAX_ALPHA = 1e6
DEFAULT_ALPHA = 8  # PEFT's LoraConfig default
MAX_PATTERN_ENTRIES = 1024
MAX_PATTERN_KEY_CHARS = 256
# `target_modules="all-linear"` saves every projection's full path: 7 per layer, 1,000 for a deep model.
MAX_TARGET_MODULES = 8192
MAX_BASE_MODEL_CHARS = 1024  # base_model_name_or_path is stored in the adapter's record
BIAS_MODES = ("none", "all", "lora_only")
# alpha_pattern keys are regular expressions (PEFT's rule); a hostile one must not hang a load. Matching
# has a time budget; compiling is bounded by the counted repetitions ({m,n}), whose product it grows with.
PATTERN_MATCH_BUDGET_S = 1.0
MAX_REPEAT_PRODUCT = 4096
_COUNTED_REPEAT = regex.compile(r"\{(\d*)(?:,(\d*))?\}")


@dataclass(frozen=True)
class LoraSettings:
    """What the engine takes from a checked adapter_config.json."""

    rank: int  # r
    alpha: float  # lora_alpha
    use_rslora: bool
    rank_pattern: dict[str, int]
    alpha_pattern: dict[str, float]
    target_modules: str | tuple[str, ...] | None  # PEFT's regex, a list, or None (PEFT's defaults)
    base_model: str | None  # base_model_name_or_path, informative only
    # alpha_pattern's keys compiled once, in order: (key, PEFT's pattern for it, alpha)
    alpha_regexes: tuple[tuple[str, regex.Pattern, float], ...] = field(default=(), repr=False, compare=False)

    def alpha_for(self, module_key: str, deadline: float) -> float:
        """PEFT's `get_pattern_key`: the first alpha_pattern key whose regex ends `module_key` wins.

        `deadline` (time.monotonic) bounds all the matching of one adapter, however many keys and modules.
        """
        for key, pattern, alpha in self.alpha_regexes:
            try:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError
                matched = pattern.match(module_key, timeout=left)
            except TimeoutError:
                raise _bad(
                    "bad_alpha_pattern",
                    "alpha_pattern",
                    f"takes too long to match the model's module names (at key {show_value(key)}); use plain "
                    "module names or simple patterns",
                ) from None
            if matched:
                return alpha
        return self.alpha


def read_adapter_config(folder: str | Path) -> dict:
    """The folder's adapter_config.json as a dict; AdapterError for a missing, huge, deep or non-JSON file."""
    path = Path(folder) / CONFIG_FILE
    if not path.is_file():
        raise AdapterError(
            "missing_config", f"{path} does not exist: a PEFT adapter folder needs {CONFIG_FILE}"
        )
    with open(path, "rb") as f:
        data = f.read(MAX_CONFIG_BYTES + 1)
    return parse_adapter_config(data)


def parse_adapter_config(data: bytes) -> dict:
    if len(data) > MAX_CONFIG_BYTES:
        raise AdapterError("bad_config", f"{CONFIG_FILE} is larger than {MAX_CONFIG_BYTES} bytes")
    try:
        config = loads_bounded(data, MAX_CONFIG_DEPTH)
    except ValueError as exc:
        raise AdapterError("bad_config", f"{CONFIG_FILE} is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise AdapterError("bad_config", f"{CONFIG_FILE} must hold a JSON object")
    return config


def check_adapter_config(
    config: Mapping, max_lora_rank: int, shape: ModelShape | None = None
) -> LoraSettings:
    """Refuse configs the engine cannot serve faithfully; AdapterError with `field` set names the key.

    `shape` gives the projections LoRA may target (the seven of a Llama-family layer when None)."""
    peft_type = config.get("peft_type")
    if not isinstance(peft_type, str) or peft_type.upper() != "LORA":
        raise AdapterError(
            "not_lora", f"peft_type is {show_value(peft_type)}; only LORA adapters are supported", "peft_type"
        )
    rank = config.get("r")
    if not _is_rank(rank):
        raise _bad("bad_rank", "r", f"must be a positive integer (got {show_value(rank)})")
    rank_pattern = _pattern_map(config, "rank_pattern", _is_rank, "positive integers")
    alpha = config.get("lora_alpha", DEFAULT_ALPHA)
    if not _is_alpha(alpha):
        raise _bad(
            "bad_alpha",
            "lora_alpha",
            f"must be a finite number within ±{MAX_ALPHA:g} (got {show_value(alpha)})",
        )
    alpha_pattern = _pattern_map(config, "alpha_pattern", _is_alpha, f"finite numbers within ±{MAX_ALPHA:g}")
    alpha_regexes = []
    for key, value in alpha_pattern.items():
        repeats = 1
        for low, high in _COUNTED_REPEAT.findall(key):
            repeats *= max(int(low or 0), int(high or 0), 1)
        if repeats > MAX_REPEAT_PRODUCT:
            raise _bad(
                "bad_alpha_pattern",
                "alpha_pattern",
                f"key {show_value(key)} repeats too much: its {{m,n}} counts multiply to more than "
                f"{MAX_REPEAT_PRODUCT}",
            )
        try:
            alpha_regexes.append((key, _pattern(key), float(value)))
        except regex.error as exc:
            raise _bad(
                "bad_alpha_pattern", "alpha_pattern", f"key {show_value(key)} is not a valid regex ({exc})"
            ) from None
    largest = max([rank, *rank_pattern.values()])
    if largest > max_lora_rank:
        key = "r" if largest == rank else "rank_pattern"
        raise AdapterError(
            "rank_too_large",
            f"adapter rank {largest} exceeds max_lora_rank {max_lora_rank}"
            + ("" if key == "r" else " (set by rank_pattern)")
            + "; start the server with a larger --max-lora-rank or retrain with a smaller r",
            key,
        )
    use_rslora = _flag(config, "use_rslora")
    if _flag(config, "use_dora"):
        raise AdapterError("dora_unsupported", "DoRA adapters (use_dora) are not supported", "use_dora")
    bias = config.get("bias")
    if bias is not None and bias not in BIAS_MODES:
        raise _bad("bad_config", "bias", f"must be one of {', '.join(BIAS_MODES)} (got {show_value(bias)})")
    if bias not in (None, "none") or _flag(config, "lora_bias"):
        raise AdapterError(
            "bias_unsupported", "adapters that train biases (bias != 'none') are not supported", "bias"
        )
    modules_to_save = _string_list(config, "modules_to_save", allow_string=False)
    if modules_to_save:
        raise AdapterError(
            "modules_to_save_unsupported",
            f"modules_to_save ({list(modules_to_save)}) is not supported: only LoRA pairs can be served",
            "modules_to_save",
        )
    if _flag(config, "fan_in_fan_out"):
        raise AdapterError(
            "fan_in_fan_out_unsupported", "fan_in_fan_out adapters are not supported", "fan_in_fan_out"
        )
    targets = _string_list(config, "target_modules", allow_string=True)
    if isinstance(targets, tuple):
        check_target_names(targets, shape or ModelShape(1, 1, 1, 1, 1, 1))
    base_model = config.get("base_model_name_or_path")
    if base_model is not None and not (
        isinstance(base_model, str) and len(base_model) <= MAX_BASE_MODEL_CHARS
    ):
        raise _bad(
            "bad_config",
            "base_model_name_or_path",
            f"must be a string of at most {MAX_BASE_MODEL_CHARS} characters or null (got {show_value(base_model)})",
        )
    return LoraSettings(
        rank=rank,
        alpha=float(alpha),
        use_rslora=use_rslora,
        rank_pattern=rank_pattern,
        alpha_pattern=alpha_pattern,
        alpha_regexes=tuple(alpha_regexes),
        target_modules=targets,
        base_model=base_model,
    )


def check_target_names(targets: tuple[str, ...], shape: ModelShape) -> None:
    """A list of target_modules as PEFT matches them: a name or a dotted path ending in one
    ("model.layers.0.self_attn.qkv_proj", as `target_modules="all-linear"` saves them)."""
    unsupported = sorted({t for t in targets if t.rsplit(".", 1)[-1] not in shape.targets})
    if unsupported:
        named = [t.rsplit(".", 1)[-1] for t in unsupported]
        raise AdapterError(
            "unsupported_target",
            f"target modules {[t if len(t) <= 60 else t[:57] + '...' for t in unsupported[:8]]} are not supported; LoRA on "
            f"{shape.model_name} may target {', '.join(shape.targets)}{shape.unsupported_targets_hint(named)}",
            "target_modules",
        )


def _is_rank(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _is_alpha(value: object) -> bool:
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
        and abs(value) <= MAX_ALPHA
    )


def _flag(config: Mapping, key: str) -> bool:
    """A true/false key; absent or null is PEFT's default, false."""
    value = config.get(key)
    if value is None or isinstance(value, bool):
        return bool(value)
    raise _bad("bad_config", key, f"must be true or false (got {show_value(value)})")


def _pattern_map(config: Mapping, key: str, valid, what: str) -> dict:
    """rank_pattern / alpha_pattern: {module name or regex: value}; absent or null is empty."""
    value = config.get(key)
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise _bad(
            f"bad_{key}", key, f"must be an object mapping module names to {what} (got {show_value(value)})"
        )
    if len(value) > MAX_PATTERN_ENTRIES:
        raise _bad(f"bad_{key}", key, f"has {len(value)} entries; at most {MAX_PATTERN_ENTRIES} are accepted")
    for name, entry in value.items():
        if not isinstance(name, str) or not 0 < len(name) <= MAX_PATTERN_KEY_CHARS:
            raise _bad(
                f"bad_{key}",
                key,
                f"keys must be module names of 1 to {MAX_PATTERN_KEY_CHARS} characters (got {show_value(name)})",
            )
        if not valid(entry):
            raise _bad(
                f"bad_{key}", key, f"values must be {what} (got {show_value(entry)} for {show_value(name)})"
            )
    return dict(value)


def _string_list(config: Mapping, key: str, allow_string: bool) -> str | tuple[str, ...] | None:
    value = config.get(key)
    if value is None or (allow_string and isinstance(value, str) and len(value) <= MAX_PATTERN_KEY_CHARS):
        return value
    if (
        isinstance(value, list)
        and len(value) <= MAX_TARGET_MODULES
        and all(isinstance(v, str) and 0 < len(v) <= MAX_PATTERN_KEY_CHARS for v in value)
    ):
        return tuple(value)
    kind = "a string or a list of strings" if allow_string else "a list of strings"
    raise _bad(
        "bad_config",
        key,
        f"must be {kind} (at most {MAX_TARGET_MODULES} names of {MAX_PATTERN_KEY_CHARS} characters) or null "
        f"(got {show_value(value)})",
    )


def _pattern(key: str) -> regex.Pattern:
    """PEFT's match for a pattern key: the key, possibly after a dotted prefix, ending the module name."""
    return regex.compile(rf"(.*\.)?({key})$")


def _bad(code: str, field: str, what: str) -> AdapterError:
    return AdapterError(code, f"{CONFIG_FILE}: {field} {what}", field)
