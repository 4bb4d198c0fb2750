"""Request intake: the checks a request passes before the engine queues it, and the params its children get.

Each check raises RequestError (or AdapterError for the adapter) naming the problem and the fix; the
engine turns that into a failed output for that request alone. Caller mistakes that are bugs rather
than bad data (a bad tenant key) raise ValueError at once.
"""

from __future__ import annotations

import dataclasses

from adapter_format.errors import AdapterError
from engine.config import EngineConfig
from engine.sampling_params import WHOLE_VOCABULARY, SamplingParams


class RequestError(ValueError):
    """A request the engine refuses (the message names the problem); the request's own data is at fault,
    so its output carries `code` as `error_code` (the API answers 400 with it)."""

    code = "invalid_request"


def check_tenant(tenant: str, tenant_weight: float) -> None:
    """The fair scheduler's key and weight must be a non-empty string and a positive finite number."""
    if not isinstance(tenant, str) or not tenant:
        raise ValueError(f"tenant must be a non-empty string or None (got {tenant!r})")
    if isinstance(tenant_weight, bool) or not isinstance(tenant_weight, (int, float)):
        raise ValueError(f"tenant_weight must be a positive number (got {tenant_weight!r})")
    if not 0 < tenant_weight < float("inf"):
        raise ValueError(f"tenant_weight must be a positive number (got {tenant_weight!r})")


def check_cache_salt(cache_salt: str | None) -> None:
    """vLLM's rule: a cache salt is None or a non-empty string."""
    if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
        raise ValueError(f"cache_salt must be a non-empty string or None (got {cache_salt!r})")


def resolve_adapter(lora, adapter: str | None) -> str | None:
    """The adapter id for a user's reference (None: the base model); AdapterError for an unknown adapter
    or one whose last load failed a moment ago. `lora` is the engine's AdapterManager."""
    if adapter is None:
        return None
    adapter_id = lora.resolve(adapter)
    reason = lora.error(adapter_id)
    if reason is not None:
        raise AdapterError("load_failed", reason)
    return adapter_id


def check_prompt(prompt_ids: list[int], max_model_len: int, vocab_size: int) -> None:
    if not prompt_ids:
        raise RequestError("the prompt is empty")
    if len(prompt_ids) >= max_model_len:
        raise RequestError(
            f"the prompt has {len(prompt_ids)} tokens, but max_model_len is {max_model_len} "
            "(prompt plus at least one generated token); shorten the prompt"
        )
    bad = [t for t in prompt_ids if not 0 <= t < vocab_size]
    if bad:
        raise RequestError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")


def check_token_ids(params: SamplingParams, vocab_size: int) -> None:
    """Token ids in logit_bias and allowed_token_ids must exist in this model's vocabulary."""
    for name, ids in (
        ("logit_bias", params.logit_bias or {}),
        ("allowed_token_ids", params.allowed_token_ids or []),
    ):
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise RequestError(f"{name} has token ids {bad[:5]} outside the vocabulary [0, {vocab_size})")


def capped_logprobs(params: SamplingParams, vocab_size: int, config: EngineConfig) -> SamplingParams:
    """vLLM's rule: -1 asks for the whole vocabulary; more than `max_logprobs` (-1: the vocabulary) is
    refused with vLLM's message. Returns the params with -1 made the vocabulary size."""
    cap = vocab_size if config.max_logprobs == -1 else config.max_logprobs
    changes = {}
    for name, kind in (("logprobs", "sample"), ("prompt_logprobs", "prompt")):
        value = getattr(params, name)
        if value == WHOLE_VOCABULARY:
            value = changes[name] = vocab_size
        if value is not None and value > cap:
            raise RequestError(
                f"Requested {kind} logprobs of {value}, which is greater than max allowed: {cap}"
            )
    return dataclasses.replace(params, **changes) if changes else params


def child_params(params: SamplingParams, index: int, eos_token_ids: list[int]) -> SamplingParams:
    """The params of child `index` of a request: each child of an n > 1 request samples independently
    (seed + index, as vLLM does), and only the first computes prompt logprobs; extra end-of-sequence ids
    of the checkpoint stop generation like eos itself. The front end applies it (the core takes the
    children as they come); applying it again to a child (index 0) changes nothing."""
    changes: dict = {"n": 1}
    if index > 0:  # the children share the prompt: the first one computes its logprobs
        changes["prompt_logprobs"] = None
    if params.seed is not None:
        changes["seed"] = params.seed + index
    extra_eos = [t for t in eos_token_ids[1:] if t not in params.stop_token_ids]
    if extra_eos and not params.ignore_eos:
        changes["stop_token_ids"] = [*params.stop_token_ids, *extra_eos]
    return dataclasses.replace(params, **changes)


def serving_max_model_len(config: EngineConfig, hf_config) -> int:
    """The context length the engine serves: `max_model_len`, else the model's max_position_embeddings."""
    limit = getattr(hf_config, "max_position_embeddings", None)
    if config.max_model_len is None:
        if limit is None:
            raise ValueError("the model config has no max_position_embeddings: set max_model_len")
        return limit
    if limit is not None and config.max_model_len > limit:
        raise ValueError(
            f"max_model_len {config.max_model_len} exceeds the model's max_position_embeddings {limit}"
        )
    return config.max_model_len
