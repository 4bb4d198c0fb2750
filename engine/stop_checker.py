"""When a request is done: stop tokens, stop strings, max_tokens and the model's context length.

One rule for `min_tokens`, shared by the sampler (which masks stop tokens), the detokenizer (which looks
for stop strings) and `check_stop`: the first `min_tokens` generated tokens never end a request; the
next one may. vLLM masks and checks the same positions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.detokenizer import IncrementalDetokenizer


@dataclass(frozen=True)
class StopResult:
    """Why a request finished.

    `stop_reason` is what OpenAI's and vLLM's `stop_reason` report: the stop string or the stop token id
    that matched, None for the eos token and for length limits.
    """

    status: RequestStatus
    stop_reason: str | int | None = None

    @property
    def finish_reason(self) -> str:
        return self.status.value


def may_stop_at(num_output_tokens: int, params: SamplingParams) -> bool:
    """Whether the `num_output_tokens`-th generated token (counting from 1) may end the request."""
    return num_output_tokens > params.min_tokens


def stop_token_reason(
    token_id: int, params: SamplingParams, eos_token_id: int | None
) -> tuple[bool, int | None]:
    """(is it a stop token, its stop_reason): eos (unless ignore_eos) has no reason, stop_token_ids do."""
    if token_id in params.stop_token_ids:
        return True, token_id
    if not params.ignore_eos and eos_token_id is not None and token_id == eos_token_id:
        return True, None
    return False, None


def check_stop(
    request: Request,
    detokenizer: IncrementalDetokenizer | None,
    new_token_ids: list[int],
    max_model_len: int,
) -> StopResult | None:
    """The request's finish status after `new_token_ids` were appended to it and detokenized, else None.

    Stops win over length limits reached by the same token (the model chose to stop; vLLM v1 says
    "length" there for eos). Within `new_token_ids` the first stop counts; the engine appends one token
    per step, so nothing follows it.
    """
    params = request.sampling_params
    if detokenizer is not None and detokenizer.stop_string is not None:
        return StopResult(RequestStatus.FINISHED_STOPPED, detokenizer.stop_string)
    first_position = request.num_output_tokens - len(new_token_ids) + 1
    for position, token_id in enumerate(new_token_ids, start=first_position):
        is_stop, reason = stop_token_reason(token_id, params, request.eos_token_id)
        if is_stop and may_stop_at(position, params):
            return StopResult(RequestStatus.FINISHED_STOPPED, reason)
    if params.max_tokens is not None and request.num_output_tokens >= params.max_tokens:
        return StopResult(RequestStatus.FINISHED_LENGTH)
    if request.num_tokens >= max_model_len:
        return StopResult(RequestStatus.FINISHED_LENGTH)
    return None
