"""Per-request output state: detokenization, stop checks, logprobs, and the n > 1 fan-in.

A user request with `n` completions becomes `n` engine requests ("children"); each child's progress
updates its slot in the parent, and the parent is what callers see as one `RequestOutput`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from engine.detokenizer import IncrementalDetokenizer
from engine.outputs import CompletionOutput, RequestOutput, RequestTimes
from engine.prompt_logprobs import PromptTokenLogprobs
from engine.request import Request, RequestStatus
from engine.sampler import TokenLogprobs
from engine.stop_checker import check_stop


@dataclass
class ParentRequest:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    adapter: str | None
    completions: list[CompletionOutput | None]
    num_cached_tokens: int = 0
    error: str | None = None
    prompt_logprobs: list[PromptTokenLogprobs | None] | None = None
    error_code: str | None = None

    @property
    def finished(self) -> bool:
        return all(c is not None and c.finish_reason is not None for c in self.completions)

    def output(self) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[c for c in self.completions if c is not None],
            finished=self.finished,
            adapter=self.adapter,
            error=self.error,
            num_cached_tokens=self.num_cached_tokens,
            prompt_logprobs=self.prompt_logprobs,
            error_code=self.error_code,
        )


@dataclass
class RequestState:
    """What the engine tracks for one child request beyond its tokens."""

    request: Request
    parent: ParentRequest
    index: int
    detokenizer: IncrementalDetokenizer | None
    logprobs: list[TokenLogprobs] | None = None
    cumulative_logprob: float | None = None
    stop_reason: str | int | None = None
    finish_reason: str | None = field(default=None)
    delta: bool = False  # publish only the tokens and logprobs new since the last publish
    num_published: int = 0  # tokens already published (delta)
    timed: bool = False  # published the times at the first token
    prompt_logprobs_published: bool = False

    def __post_init__(self) -> None:
        if self.request.sampling_params.logprobs is not None:
            self.logprobs, self.cumulative_logprob = [], 0.0

    def append(
        self, token_id: int, logprobs: TokenLogprobs | None, max_model_len: int
    ) -> RequestStatus | None:
        """Record a sampled token (already appended to the request); returns a finished status or None."""
        if logprobs is not None and self.logprobs is not None:
            self.logprobs.append(logprobs)
            self.cumulative_logprob += logprobs.logprob
        if self.detokenizer is not None:
            self.detokenizer.update([token_id])
        result = check_stop(self.request, self.detokenizer, [token_id], max_model_len)
        if result is None:
            return None
        self.stop_reason = result.stop_reason
        return result.status

    def publish(self) -> RequestOutput:
        """Update the parent with this child's current completion and return the parent's output."""
        request = self.request
        finished = request.status.finished
        text = self.detokenizer.get_next_output_text(finished, delta=self.delta) if self.detokenizer else ""
        first = self.num_published if self.delta else 0
        self.num_published = len(request.output_token_ids)
        self.parent.completions[self.index] = CompletionOutput(
            index=self.index,
            text=text,
            token_ids=request.output_token_ids[first:],
            cumulative_logprob=self.cumulative_logprob,
            logprobs=self.logprobs[first:] if self.logprobs is not None else None,
            finish_reason=request.status.finish_reason,
            stop_reason=self.stop_reason,
            # with the first tokens too: the front end extends them when a stop string ends the request there
            times=request_times(request) if finished or not self.timed else None,
        )
        self.timed = self.timed or request.first_token_time is not None
        if request.error and self.parent.error is None:
            self.parent.error, self.parent.error_code = request.error, request.error_code
        if self.index == 0:  # the prompt is counted once, as the first completion's (vLLM's usage does so)
            self.parent.num_cached_tokens = request.num_cached_tokens
            complete = request.prompt_logprobs is not None and not request.needs_prompt_logprobs
            if complete and not self.prompt_logprobs_published:  # copied once: they never change after
                self.parent.prompt_logprobs = list(request.prompt_logprobs)
                self.prompt_logprobs_published = True
            elif self.delta:  # a delta output carries them once, with the first tokens
                self.parent.prompt_logprobs = None
        return self.parent.output()


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
