"""The model's own sampling defaults (its `generation_config.json`), for fields a request leaves unset.

As vLLM does with `--generation-config auto`: a model folder's `generation_config.json` may recommend
`temperature`, `top_p`, `top_k`, `min_p` and `repetition_penalty` (the sampling keys vLLM reads); those
apply to every request that does not set the field itself. Other keys (`do_sample`, `max_new_tokens`,
...) are not read, and a value out of range is ignored with a log line, never refused. `"vllm"` ignores
the file: SamplingParams' own defaults.

    defaults = load_generation_defaults(model_path)      # {"temperature": 0.2, "top_p": 0.9}
    params = apply_generation_defaults(defaults, temperature=None, max_tokens=32)   # temperature 0.2
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from engine.engine_args import GENERATION_CONFIGS
from engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

GENERATION_CONFIG_FILE = "generation_config.json"
# The sampling defaults vLLM reads from the file (its max_new_tokens aside); this engine honours each.
_SUPPORTED = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def load_generation_defaults(model_path: str | Path, mode: str = "auto") -> dict[str, Any]:
    """The supported sampling fields the model's generation_config.json sets; {} without one, or for "vllm"."""
    if mode not in GENERATION_CONFIGS:
        raise ValueError(f"generation_config must be one of {', '.join(GENERATION_CONFIGS)} (got {mode!r})")
    path = Path(model_path) / GENERATION_CONFIG_FILE
    if mode == "vllm" or not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        logger.warning("%s is unreadable (%s); no sampling defaults from it", path, exc)
        return {}
    if not isinstance(config, dict):
        return {}
    defaults = {key: config[key] for key in _SUPPORTED if key in config and _valid(key, config[key])}
    for key in _SUPPORTED:
        if key in config and key not in defaults:
            logger.warning("%s: %s=%r is out of range; ignored", path, key, config[key])
    if defaults:
        logger.info("sampling defaults from %s: %s", path, defaults)
    return defaults


def apply_generation_defaults(defaults: Mapping[str, Any], **fields: Any) -> SamplingParams:
    """SamplingParams of `fields`; a sampling field of the file's (temperature, top_p, top_k, min_p,
    repetition_penalty) left out or None takes the model's default, else SamplingParams' own. Other
    fields pass through as given (None included: `max_tokens=None`).

    One place for the rule, used by the server (every OpenAI request) and the offline `LLM`.
    """
    chosen = dict(fields)
    for key in _SUPPORTED:
        if chosen.get(key) is None:
            chosen.pop(key, None)
            if key in defaults:
                chosen[key] = defaults[key]
    return SamplingParams(**chosen)


def _valid(key: str, value: Any) -> bool:
    if key == "top_k":
        return isinstance(value, int) and not isinstance(value, bool) and value >= -1
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        return False
    if key == "temperature":
        return value >= 0.0
    if key == "repetition_penalty":
        return value > 0.0
    if key == "min_p":
        return 0.0 <= value <= 1.0
    return 0.0 < value <= 1.0  # top_p
