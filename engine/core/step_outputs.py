"""A step's sampled tokens become token deltas (engine.messages.RequestDelta), one per request record.

Sampling is launched on the device and read back later (with async scheduling, a step later); a batch
whose sampling raises is sampled row by row, so one request's bad data fails that request alone. Each
row's tokens go through the request's token-level stop checks and structured-output matcher, and the
tokens kept become the request's delta, read straight from its record (`LiveRequest.delta`). Text, stop
strings, the `n > 1` fan-in and the sums over a request's tokens are the front end's
(engine/frontend/output_processor.py): the core sees one sequence per request and never a stop string.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from engine.core.request_checks import RequestError
from engine.logits_processors import uses_processors
from engine.messages import RequestDelta
from engine.outputs import RequestTimes
from engine.request import Request, RequestStatus
from engine.sampler import SampledStep, Sampler, on_device
from engine.stop_checker import check_stop
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


@dataclass(eq=False)
class LiveRequest:
    """A request record in the core and what was sent of it: its deltas are read from it."""

    request: Request
    counts_prompt: bool = True  # its prompt is counted with its first token (AddRequest.counts_prompt)
    stop_reason: int | None = None  # the stop token id that ended it
    timed: bool = False  # its times went out with its first token
    prompt_logprobs_sent: bool = False

    def delta(self, new_token_ids: list[int], new_logprobs: list | None) -> RequestDelta:
        """What the request gained since its last delta (its tokens and their logprobs as given), its
        finish, its prompt logprobs once complete (once), its times with its first token and at the end."""
        request = self.request
        finished = request.status.finished
        times = request_times(request) if finished or not self.timed else None
        self.timed = self.timed or request.first_token_time is not None
        prompt_logprobs = None
        if request.prompt_logprobs is not None and not request.needs_prompt_logprobs:
            if not self.prompt_logprobs_sent:  # copied once: they never change after
                prompt_logprobs, self.prompt_logprobs_sent = list(request.prompt_logprobs), True
        stopped_by_token = request.status is RequestStatus.FINISHED_STOPPED
        return RequestDelta(
            request_id=request.request_id,
            new_token_ids=new_token_ids,
            logprobs=new_logprobs if request.sampling_params.logprobs is not None else None,
            finish_reason=request.status.finish_reason,
            stop_reason=self.stop_reason if stopped_by_token else None,
            error=request.error,
            num_cached_tokens=request.num_cached_tokens,
            prompt_logprobs=prompt_logprobs,
            times=times,
            error_code=request.error_code,
        )


def append_tokens(
    live: LiveRequest,
    token_ids: list[int | None],
    token_logprobs: list,
    max_model_len: int,
    structured: StructuredOutputs,
    count_token,
) -> tuple[RequestStatus | None, list]:
    """Append a step's kept tokens to one request: (its finished status or None if it goes on, the
    logprobs of the tokens appended). A token id of None means its sampling raised (the logprobs hold
    the error): the request fails alone. `count_token(live)` is called for each token appended."""
    request = live.request
    kept_logprobs = []
    try:
        status = None
        for token_id, logprobs in zip(token_ids, token_logprobs):
            if token_id is None:  # its own sampling raised: logprobs holds the reason
                raise logprobs
            request.append_output_token(token_id)
            if request.first_token_time is None:
                request.first_token_time = time.monotonic()
            count_token(live)
            if logprobs is not None:
                kept_logprobs.append(logprobs)
            result = check_stop(request, None, [token_id], max_model_len)
            if result is not None:
                status, live.stop_reason = result.status, result.stop_reason
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
    return status, kept_logprobs


def needs_last_token(request: Request) -> bool:
    """Whether sampling the request's next token reads its previous one on the host (penalties, grammars):
    with async scheduling, a token still in flight is read back first."""
    params = request.sampling_params
    return bool(request.num_in_flight) and (params.structured_outputs is not None or uses_processors(params))


def refused_delta(request_id: str, message: str, error_code: str | None = None) -> RequestDelta:
    """The one delta of a request refused before it was queued: finished, with the reason."""
    return RequestDelta(request_id, [], finish_reason="error", error=message, error_code=error_code)


def request_times(request: Request) -> RequestTimes | None:
    """A request's queue, prefill, decode and inference seconds so far; None before its first token."""
    if request.scheduled_time is None or request.first_token_time is None:
        return None
    end = time.monotonic()
    return RequestTimes(
        queue=request.scheduled_time - request.arrival_time,
        prefill=request.first_token_time - request.scheduled_time,
        decode=end - request.first_token_time,
        inference=end - request.scheduled_time,
    )
