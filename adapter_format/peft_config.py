"""adapter_config.json: read with bounded nesting, every key the engine relies on checked for type and range.

The one place for these rules: the adapter store runs them on uploads (a 422 naming the field) and the
engine on every folder it loads (an AdapterError naming the field), so a config the store took is one
the engine serves. Whether PEFT would load it as a causal-LM LoRA at all (peft_type, task_type, features
the engine cannot run) is peft_features.py's part, and which modules it wraps peft_targets.py's. Keys that
only shape training (lora_dropout, init_lora_weights, ...) are not checked.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import regex

from adapter_format.bounded_json import loads_bounded
from adapter_format.errors import AdapterError, show_value
from adapter_format.expert_lora import EXPERT_PART_NAMES, read_target_parameters
from adapter_format.files import CONFIG_FILE
from adapter_format.model_shape import EXPERT_GATES, ModelShape
from adapter_format.module_patterns import compile_pattern, search
from adapter_format.peft_features import check_features, check_peft_type, check_task_type
from adapter_format.peft_targets import Targets, read_targets
from adapter_format.vocab_modules import VOCAB_MODULES, read_modules_to_save

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
    use_dora: bool = False  # DoRA: every LoRA pair comes with a magnitude vector (checkpoint.py)
    # modules_to_save: the vocabulary modules (embed_tokens, lm_head) the adapter holds whole copies of,
    # and ensure_weight_tying (vocab_modules.py)
    modules_to_save: tuple[str, ...] = ()
    ensure_weight_tying: bool = False
    # Which (layer, projection) pairs PEFT wraps: tensors for any other are refused (peft_targets.py).
    targets: Targets | None = field(default=None, repr=False, compare=False)
    # The stacked expert weights target_parameters adapts (a mixture of experts; expert_lora.py).
    target_parameters: tuple[str, ...] = ()
    # rank_pattern's and alpha_pattern's keys compiled once, in order: (PEFT's pattern for the key, value)
    rank_regexes: tuple[tuple[regex.Pattern, int], ...] = field(default=(), repr=False, compare=False)
    alpha_regexes: tuple[tuple[regex.Pattern, float], ...] = field(default=(), repr=False, compare=False)

    def rank_for(self, module_key: str, deadline: float) -> int:
        """The rank PEFT gives a module: the first rank_pattern key whose regex ends `module_key`, else r."""
        return _first_match(self.rank_regexes, module_key, deadline, "rank_pattern", self.rank)

    def alpha_for(self, module_key: str, deadline: float) -> float:
        """PEFT's `get_pattern_key`: the first alpha_pattern key whose regex ends `module_key` wins.

        `deadline` (time.monotonic) bounds all the matching of one adapter, however many keys and modules.
        """
        return _first_match(self.alpha_regexes, module_key, deadline, "alpha_pattern", self.alpha)


def _first_match(regexes, module_key: str, deadline: float, field_name: str, default):
    for pattern, value in regexes:
        if search(pattern, module_key, deadline, field_name) is not None:
            return value
    return default


def read_adapter_config(folder: str | Path) -> dict:
    """The folder's adapter_config.json as a dict; AdapterError for a missing, huge, deep or non-JSON file."""
    path = Path(folder) / CONFIG_FILE
    if not path.is_file():
        # The file's name only: the folder may be a server's staging folder, which no message may show.
        raise AdapterError(
            "missing_config",
            f"no {CONFIG_FILE} found: a PEFT adapter folder needs {CONFIG_FILE} (save_pretrained writes it)",
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
    check_peft_type(config)
    check_task_type(config)
    check_features(config, allowed=("target_parameters",) if shape is not None and shape.num_experts else ())
    target_parameters = (
        read_target_parameters(config, shape) if shape is not None and shape.num_experts else ()
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
    largest = max([rank, *rank_pattern.values()])
    if largest > max_lora_rank:
        key = "r" if largest == rank else "rank_pattern"
        raise AdapterError(
            "rank_too_large",
            f"adapter rank {largest} is greater than max_lora_rank {max_lora_rank}"
            + ("" if key == "r" else " (set by rank_pattern)")
            + "; start the server with a larger --max-lora-rank or retrain with a smaller r",
            key,
        )
    use_rslora = _flag(config, "use_rslora")
    use_dora = _flag(config, "use_dora")
    bias = config.get("bias")
    if bias is not None and bias not in BIAS_MODES:
        raise _bad("bad_config", "bias", f"must be one of {', '.join(BIAS_MODES)} (got {show_value(bias)})")
    if bias not in (None, "none") or _flag(config, "lora_bias"):
        raise AdapterError(
            "bias_unsupported",
            "Adapter bias cannot be used without bias_enabled, which this server does not have: adapters "
            "that train biases (bias != 'none') are not supported",
            "bias",
        )
    modules_to_save = read_modules_to_save(_string_list(config, "modules_to_save", allow_string=False))
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
        target_modules=targets,
        base_model=base_model,
        use_dora=use_dora,
        modules_to_save=modules_to_save,
        ensure_weight_tying=_flag(config, "ensure_weight_tying"),
        targets=read_targets(config, targets),
        target_parameters=target_parameters,
        rank_regexes=_compiled(rank_pattern, "rank_pattern", int),
        alpha_regexes=_compiled(alpha_pattern, "alpha_pattern", float),
    )


def _compiled(patterns: dict, field_name: str, convert) -> tuple:
    """PEFT's match for a pattern key: the key, possibly after a dotted prefix, ending the module name."""
    return tuple(
        (compile_pattern(key, field_name, r"(.*\.)?({})$"), convert(v)) for key, v in patterns.items()
    )


def check_target_names(targets: tuple[str, ...], shape: ModelShape) -> None:
    """A list of target_modules as PEFT matches them: a name or a dotted path ending in one
    ("model.layers.0.self_attn.qkv_proj", as `target_modules="all-linear"` saves them)."""
    allowed = set(shape.targets) | set(VOCAB_MODULES)
    # The experts' gates are left to the tensors: PEFT saves all-linear's list with `shared_expert_gate` in
    # it even where exclude_modules kept it unwrapped; a gate's LoRA tensor is refused, naming it.
    allowed |= {*EXPERT_PART_NAMES, *EXPERT_GATES} if shape.num_experts else set()
    unsupported = sorted({t for t in targets if t.rsplit(".", 1)[-1] not in allowed})
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


def _bad(code: str, field: str, what: str) -> AdapterError:
    return AdapterError(code, f"{CONFIG_FILE}: {field} {what}", field)
