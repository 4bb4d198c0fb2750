"""Per-request output state: detokenization, stop checks, logprobs, and the n > 1 fan-in.

A user request with `n` completions becomes `n` engine requests ("children"); each child's progress
updates its slot in the parent, and the parent is what callers see as one `RequestOutput`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.detokenizer import IncrementalDetokenizer
from engine.outputs import CompletionOutput, RequestOutput
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
        )
        if request.error and self.parent.error is None:
            self.parent.error = request.error
        if self.index == 0:  # the prompt is counted once, as the first completion's (vLLM's usage does so)
            self.parent.num_cached_tokens = request.num_cached_tokens
        return self.parent.output()
