"""What `LLM.generate` returns and the async API streams, named as in vLLM."""

from __future__ import annotations

from dataclasses import dataclass

from engine.prompt_logprobs import PromptTokenLogprobs
from engine.sampler import TokenLogprobs


@dataclass(frozen=True)
class RequestTimes:
    """Where one engine request's time went, in seconds, as vLLM's request_*_time_seconds histograms
    measure it: arrival -> first scheduled (queue) -> first token (prefill) -> last token (decode);
    inference is first scheduled -> last token."""

    queue: float
    prefill: float
    decode: float
    inference: float


@dataclass
class CompletionOutput:
    """One generated sequence of a request (a request with `n` > 1 has `n` of them).

    While streaming with deltas, `text`, `token_ids` and `logprobs` hold only what is new since the last
    output; `cumulative_logprob` is always the sum over every token so far.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[TokenLogprobs] | None  # one per generated token, when the request asked for logprobs
    finish_reason: str | None  # "stop" | "length" | "abort" | "error"; None while running
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it; None for eos
    times: RequestTimes | None = None  # when finished (and with its first token), if it got a token

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """Everything a caller learns about one request at one point in time."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    adapter: str | None = None  # the adapter that served it (e.g. "name@3"); None: the base model
    error: str | None = None  # why the request failed (finish_reason "error"), naming the problem
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    # With params.prompt_logprobs: one entry per prompt token, None for the first (vLLM's). A delta
    # stream carries it once, in the first delta.
    prompt_logprobs: list[PromptTokenLogprobs | None] | None = None
    error_code: str | None = None  # set when the request's own data failed it (see Request.error_code)
