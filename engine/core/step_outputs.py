"""Output assembly: a step's sampled tokens become request outputs, one per request per step.

Sampling is launched on the device and read back later (with async scheduling, a step later); a batch
whose sampling raises is sampled row by row, so one request's bad data fails that request alone. Each
row's tokens go through the request's stop checks and structured-output matcher; the outputs of a step
are then reduced to one per user request (the latest, or with delta outputs the step's deltas joined).
"""

from __future__ import annotations

import logging
import time

import torch

from engine.core.request_checks import RequestError
from engine.logits_processors import uses_processors
from engine.output_processor import RequestState
from engine.outputs import CompletionOutput, RequestOutput
from engine.request import Request, RequestStatus
from engine.sampler import SampledStep, Sampler, on_device
from engine.structured_output.matchers import StructuredOutputs

logger = logging.getLogger(__name__)

# A step's sampling: queued on the device, plus its rows if they were already resolved one by one.
Sampled = tuple[SampledStep, list | None]


def launch_sampling(sampler: Sampler, logits, requests: list[Request]) -> Sampled:
    """The step's sampling, queued on the device. If sampling the batch raises, each row is sampled
    alone at once, so one request's data (a seed torch refuses, say) fails that request alone while
    the others keep their tokens; the rows then come back resolved, failed ones with the error."""
    try:
        return sampler.launch(logits, requests), None
    except Exception:
        logger.exception("sampling a batch of %d failed; sampling its rows one by one", len(requests))
    rows = []
    for i, request in enumerate(requests):
        try:
            one = sampler(logits[i : i + 1], [request])
            rows.append((request, one.token_ids[0], one.logprobs[0]))
        except Exception as exc:
            rows.append((request, None, exc))
    tokens = [0 if token_id is None else token_id for _, token_id, _ in rows]
    resolved = SampledStep(requests, on_device(tokens, logits.device), [], [torch.tensor(tokens)], None)
    return resolved, rows


def sampled_rows(sampled: Sampled) -> list[tuple[Request, int | None, object]]:
    """(request, token id, logprobs) per row; (request, None, error) for a row whose sampling raised."""
    step, rows = sampled
    if rows is not None:
        return rows
    result = step.result()
    return list(zip(step.requests, result.token_ids, result.logprobs))


def append_tokens(
    state: RequestState,
    token_ids: list[int | None],
    token_logprobs: list,
    max_model_len: int,
    structured: StructuredOutputs,
    count_token,
) -> RequestStatus | None:
    """Append a step's kept tokens to one request; returns its finished status, or None if it goes on.
    A token id of None means its sampling raised (the logprobs hold the error): the request fails alone.
    `count_token(state)` is called for each token appended (the engine's counters)."""
    request = state.request
    try:
        status = None
        for token_id, logprobs in zip(token_ids, token_logprobs):
            if token_id is None:  # its own sampling raised: logprobs holds the reason
                raise logprobs
            request.append_output_token(token_id)
            if request.first_token_time is None:
                request.first_token_time = time.monotonic()
            count_token(state)
            status = state.append(token_id, logprobs, max_model_len)
            if structured.accept(request, token_id) and status is None:
                status = RequestStatus.FINISHED_STOPPED  # the structure is complete
            if status is not None:
                break  # tokens kept after a stop are dropped
    except Exception as exc:  # this request's data broke its own step: fail it, not the batch
        if isinstance(exc, RequestError):  # the request's own limits (its grammar ran dry): no traceback
            logger.warning("request %s failed in its step: %s", request.request_id, exc)
        else:
            logger.exception("request %s failed in its step", request.request_id)
        request.error = f"the request failed while generating: {exc}"
        request.error_code = exc.code if isinstance(exc, RequestError) else None
        status = RequestStatus.FINISHED_ERROR
    return status


def needs_last_token(request: Request) -> bool:
    """Whether sampling the request's next token reads its previous one on the host (penalties, grammars):
    with async scheduling, a token still in flight is read back first."""
    params = request.sampling_params
    return bool(request.num_in_flight) and (params.structured_outputs is not None or uses_processors(params))


def refused_output(
    request_id: str,
    prompt_text: str | None,
    prompt_ids: list[int],
    adapter: str | None,
    message: str,
    error_code: str | None = None,
) -> RequestOutput:
    """The one output of a request refused before it was queued: finished, with the reason."""
    completion = CompletionOutput(0, "", [], None, None, RequestStatus.FINISHED_ERROR.finish_reason, None)
    return RequestOutput(
        request_id, prompt_text, prompt_ids, [completion], True, adapter, message, error_code=error_code
    )


def latest_per_request(outputs: list[RequestOutput]) -> list[RequestOutput]:
    """One output per user request per step (children of an n > 1 request each publish)."""
    latest: dict[str, RequestOutput] = {}
    for output in outputs:
        latest[output.request_id] = output
    return list(latest.values())


def merge_deltas(outputs: list[RequestOutput]) -> list[RequestOutput]:
    """One output per request per step, a request's deltas of the step joined in order."""
    merged: dict[str, RequestOutput] = {}
    for output in outputs:
        earlier = merged.get(output.request_id)
        if earlier is not None and earlier.outputs and output.outputs:
            before, now = earlier.outputs[0], output.outputs[0]
            now.token_ids = before.token_ids + now.token_ids
            if before.logprobs is not None and now.logprobs is not None:
                now.logprobs = before.logprobs + now.logprobs
        merged[output.request_id] = output
    return list(merged.values())
