"""`speculative_config`, as vLLM names it: `{"method": "ngram", "num_speculative_tokens": k,
"prompt_lookup_max": n, "prompt_lookup_min": m}` or `{"method": "draft_model", "model": PATH,
"num_speculative_tokens": k}`; validated once, here."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

METHODS = ("ngram", "draft_model")
# vLLM's default n-gram window when neither bound is given (its own comment: arbitrarily chosen).
DEFAULT_PROMPT_LOOKUP = 5
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    """How requests speculate. The last four fields are loraserve's: the per-request fallback, and
    whether verification steps replay CUDA graphs."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int | None = None  # ngram: longest suffix looked up in the request's tokens
    prompt_lookup_min: int | None = None  # ngram: shortest
    model: str | None = None  # draft_model: a local folder or hub id with the target's vocabulary
    # vLLM's: no request speculates in a step where more requests than this are running (None: no limit).
    disable_by_batch_size: int | None = None
    # A request whose drafts were accepted at less than this rate over its last `fallback_window`
    # verifications stops speculating for `fallback_cooldown` steps (0 turns the fallback off).
    fallback_acceptance_rate: float = 0.2
    fallback_window: int = 8
    fallback_cooldown: int = 32
    # On CUDA with decode graphs: verification steps replay CUDA graphs (spec_decode/verify_graphs.py).
    cuda_graphs: bool = True

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(
                f"speculative_config method must be one of {', '.join(METHODS)} (got {self.method!r})"
            )
        _int_in("num_speculative_tokens", self.num_speculative_tokens, 1, MAX_SPECULATIVE_TOKENS)
        if self.method == "ngram":
            if self.model is not None:
                raise ValueError("speculative_config: 'model' is for method draft_model, not ngram")
            low, high = self.prompt_lookup_min, self.prompt_lookup_max
            if low is None and high is None:
                low = high = DEFAULT_PROMPT_LOOKUP
            low = high if low is None else low
            high = low if high is None else high
            _int_in("prompt_lookup_min", low, 1, 1024)
            _int_in("prompt_lookup_max", high, 1, 1024)
            if low > high:
                raise ValueError(
                    f"speculative_config: prompt_lookup_min ({low}) exceeds prompt_lookup_max ({high})"
                )
            object.__setattr__(self, "prompt_lookup_min", low)
            object.__setattr__(self, "prompt_lookup_max", high)
        else:
            if not isinstance(self.model, str) or not self.model:
                raise ValueError("speculative_config: method draft_model needs 'model' (a folder or hub id)")
            if self.prompt_lookup_min is not None or self.prompt_lookup_max is not None:
                raise ValueError("speculative_config: prompt_lookup_min/max are for method ngram")
        if self.disable_by_batch_size is not None:
            _int_in("disable_by_batch_size", self.disable_by_batch_size, 1, 1 << 30)
        rate = self.fallback_acceptance_rate
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0.0 <= rate <= 1.0:
            raise ValueError(f"speculative_config: fallback_acceptance_rate must be in [0, 1] (got {rate!r})")
        _int_in("fallback_window", self.fallback_window, 1, 1 << 20)
        _int_in("fallback_cooldown", self.fallback_cooldown, 0, 1 << 30)
        if not isinstance(self.cuda_graphs, bool):
            raise ValueError(f"speculative_config: cuda_graphs must be a bool (got {self.cuda_graphs!r})")

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict[str, Any] | str | None) -> SpeculativeConfig | None:
        """A config from a dict or its JSON text (the CLI's form); ValueError naming unknown keys."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                raise ValueError(f"speculative_config is not valid JSON: {value!r}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object (got {type(value).__name__})")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown keys {unknown}; known: {sorted(known)}")
        value = dict(value)
        if value.get("method") is None:  # vLLM infers the method from a model
            value["method"] = "draft_model" if value.get("model") else "ngram"
        if "num_speculative_tokens" not in value:
            raise ValueError("speculative_config needs num_speculative_tokens")
        return cls(**value)


def _int_in(name: str, value: Any, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"speculative_config: {name} must be an integer in [{low}, {high}] (got {value!r})")
