"""Request intake: the checks a request passes before the engine queues it, and the params its children get.

Each check raises RequestError (or AdapterError for the adapter) naming the problem and the fix; the
engine turns that into a failed output for that request alone. Caller mistakes that are bugs rather
than bad data (a bad tenant key) raise ValueError at once. The HTTP server runs the same checks
(`check_prompt`, `check_token_ids`, `check_logprobs`) before it queues anything, so its 400s and the
engine's refusals say the same (its error table maps RequestError, `code` and `param` included).
"""

from __future__ import annotations

import dataclasses

from adapter_format.errors import AdapterError
from engine.config import EngineConfig
from engine.sampling_params import WHOLE_VOCABULARY, SamplingParams


class RequestError(ValueError):
    """A request the engine refuses (the message names the problem); the request's own data is at fault,
    so its output carries `code` as `error_code` (the API answers 400 with it, and `param`, the request
    field at fault, when there is one)."""

    code = "invalid_request"

    def __init__(self, message: str, *, code: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code
        self.param = param


def check_priority(priority: int, policy_uses_priority: bool, policy: str) -> None:
    """vLLM's rule: a non-zero priority only under a policy that orders by it (never silently ignored)."""
    if priority != 0 and not policy_uses_priority:
        raise RequestError(
            f"priority {priority} needs the 'priority' scheduling policy (--scheduling-policy priority); "
            f"this engine schedules by {policy!r}: leave priority at 0"
        )


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


def check_prompt(prompt_ids: list[int], max_model_len: int | None, vocab_size: int | None) -> None:
    """A prompt must hold at least one token, leave room for one generated token in the context, and name
    tokens of the vocabulary (None: a limit the caller does not know, not checked)."""
    if not prompt_ids:
        raise RequestError("the prompt is empty", param="prompt")
    if max_model_len is not None and len(prompt_ids) >= max_model_len:
        raise RequestError(
            f"the prompt has {len(prompt_ids)} tokens, but this model's context (max_model_len) is "
            f"{max_model_len} tokens, prompt plus output; shorten the prompt",
            code="context_length_exceeded",
            param="prompt",
        )
    bad = None if vocab_size is None else next((t for t in prompt_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise RequestError(
            f"Token id {bad} is out of vocabulary: prompt token ids must lie in [0, {vocab_size})",
            param="prompt",
        )


def check_token_ids(params: SamplingParams, vocab_size: int, *, stop_token_ids: bool = False) -> None:
    """Token ids in logit_bias and allowed_token_ids must exist in this model's vocabulary. The server
    checks stop_token_ids too (a 400 before queueing); the engine, as vLLM's, lets an id it can never
    sample be (it never stops anything)."""
    fields = [("logit_bias", params.logit_bias or {}), ("allowed_token_ids", params.allowed_token_ids or [])]
    if stop_token_ids:
        fields.append(("stop_token_ids", params.stop_token_ids))
    for name, ids in fields:
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise RequestError(
                f"{name} has token ids {bad[:5]} outside the vocabulary [0, {vocab_size})", param=name
            )


def check_logprobs(
    kind: str, value: int | None, max_logprobs: int, vocab_size: int | None, param: str | None = None
) -> int | None:
    """vLLM's rule for a count of `kind` ("sample" or "prompt") logprobs: -1 asks for the whole
    vocabulary; more than `max_logprobs` (-1: the vocabulary) is refused with vLLM's message. Returns the
    count with -1 made the vocabulary size (kept -1 while the size is unknown, None)."""
    if value is None:
        return None
    asked = vocab_size if value == WHOLE_VOCABULARY else value  # None: the whole of an unknown vocabulary
    cap = vocab_size if max_logprobs == -1 else max_logprobs  # None: no known cap
    if cap is None or (asked is not None and asked <= cap):
        return value if asked is None else asked
    shown = "the whole vocabulary (-1)" if asked is None else str(asked)
    raise RequestError(
        f"Requested {kind} logprobs of {shown}, which is greater than max allowed: {cap}", param=param
    )


def capped_logprobs(params: SamplingParams, vocab_size: int, config: EngineConfig) -> SamplingParams:
    """`check_logprobs` on the params' two counts; returns the params with -1 made the vocabulary size."""
    changes = {}
    for name, kind in (("logprobs", "sample"), ("prompt_logprobs", "prompt")):
        value = getattr(params, name)
        checked = check_logprobs(kind, value, config.max_logprobs, vocab_size, name)
        if checked != value:
            changes[name] = checked
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
