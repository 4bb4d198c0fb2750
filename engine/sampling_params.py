"""Per-request sampling settings, named and defaulted as in vLLM and the OpenAI API."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from engine.structured_output.params import StructuredOutputsParams

# Below this temperature sampling is greedy (argmax), as vLLM does.
GREEDY_EPSILON = 1e-5
# A seed is a 64-bit signed integer, as in vLLM; n > 1 adds the child's index, which torch's generators
# (seeds up to 2**64 - 1) still take.
MIN_SEED, MAX_SEED = -(2**63), 2**63 - 1


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop, for one request.

    `seed` makes a sampled request reproducible: the same seed gives the same tokens whatever else
    shares the batch. `logprobs=n` returns the top-n log-probabilities of the model's distribution
    (before temperature and truncation) plus the sampled token's at every step.
    """

    n: int = 1
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k limit
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    min_tokens: int = 0
    # Constrain the output to a JSON schema, JSON, a regex, a choice or a grammar (vLLM's name and type;
    # a dict of the same fields is accepted too).
    structured_outputs: StructuredOutputsParams | None = None
    # Logits edits (engine/logits_processors.py), named and bounded as in vLLM and OpenAI.
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    min_p: float = 0.0
    # loraserve's extension: False keeps this request out of speculative decoding (engine/spec_decode/).
    speculative: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        else:
            self.stop = list(self.stop)
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop must hold non-empty strings")
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be at least 1 (got {self.n!r})")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be at least 1 (got {self.max_tokens!r})")
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be non-negative (got {self.temperature})")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1] (got {self.top_p})")
        if self.seed is not None and (
            not isinstance(self.seed, int)
            or isinstance(self.seed, bool)
            or not MIN_SEED <= self.seed <= MAX_SEED
        ):
            raise ValueError(f"seed must be a 64-bit integer in [{MIN_SEED}, {MAX_SEED}] (got {self.seed!r})")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be -1, 0 (off) or a positive integer (got {self.top_k!r})")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be between 0 and 20 (got {self.logprobs})")
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputsParams
        ):
            raise ValueError("structured_outputs must be a StructuredOutputsParams (or a dict of its fields)")
        if not self.repetition_penalty > 0.0 or not math.isfinite(self.repetition_penalty):
            raise ValueError(f"repetition_penalty must be a positive number (got {self.repetition_penalty})")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2] (got {getattr(self, name)})")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1] (got {self.min_p})")
        if self.logit_bias is not None:
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            if any(not -100.0 <= v <= 100.0 for v in self.logit_bias.values()):
                raise ValueError("logit_bias values must be in [-100, 100]")
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must not be empty")
        if not isinstance(self.speculative, bool):
            raise ValueError(f"speculative must be true or false (got {self.speculative!r})")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be non-negative (got {self.min_tokens})")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPSILON
