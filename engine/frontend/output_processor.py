"""The front end's half of a request: text, stop strings, logprobs and the `n > 1` fan-in.

A user request with `n` completions is `n` core requests ("children", ids `req#i` when n > 1, each
seeded `seed + i` as vLLM does). The core sends each child's new token ids; here they become text
(IncrementalDetokenizer), a stop string ends a child (and the caller aborts it in the core), and the
children's news of one message merge into one RequestOutput delta: each completion published so far
and not yet finished in an earlier delta, holding only what is new since the previous delta.

By vLLM's convention a stop token stays in `token_ids` but adds no text; the detokenizer knows the stop
tokens from the child's params (engine.core.request_checks.child_params, the rule the core applies too).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

from engine.core.request_checks import child_params
from engine.detokenizer import IncrementalDetokenizer
from engine.messages import AddRequest, RequestDelta
from engine.outputs import CompletionOutput, RequestOutput, RequestTimes
from engine.prompt_logprobs import PromptTokenLogprobs
from engine.request import Request, RequestStatus
from engine.request_meta import RequestMeta
from engine.sampler import TokenLogprobs
from engine.sampling_params import SamplingParams

_STOP = RequestStatus.FINISHED_STOPPED.finish_reason


@dataclass
class _Child:
    index: int
    detokenizer: IncrementalDetokenizer | None
    logprobs: bool
    published: bool = False  # appeared in a delta: from then on it is part of the request's outputs
    done: bool = False  # its final completion went out: later deltas leave it out
    num_tokens: int = 0
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    times: RequestTimes | None = None  # once finished
    _first_times: RequestTimes | None = None  # the core's, at the first token, and when they arrived
    _first_seen: float = 0.0
    # News since the last delta.
    new_token_ids: list[int] = field(default_factory=list)
    new_logprobs: list[TokenLogprobs] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.logprobs:
            self.cumulative_logprob = 0.0

    def apply(self, delta: RequestDelta) -> bool:
        """Take one core delta; True when a stop string ended the child here (the core must abort it)."""
        self.published = True
        if delta.times is not None and self._first_times is None:
            self._first_times, self._first_seen = delta.times, time.monotonic()
        ids = delta.new_token_ids
        stop_string = None
        if self.detokenizer is not None:
            # Token by token: a step of speculative decoding brings several, and those after the one that
            # completes a stop string are not part of the output.
            for count, token_id in enumerate(ids, start=1):
                stop_string = self.detokenizer.update([token_id])
                if stop_string is not None:
                    ids = ids[:count]
                    break
        self.new_token_ids.extend(ids)
        self.num_tokens += len(ids)
        for item in (delta.logprobs or ())[: len(ids)]:
            self.new_logprobs.append(item)
            self.cumulative_logprob += item.logprob
        if stop_string is not None:
            self.finish_reason, self.stop_reason = _STOP, stop_string
            self.times = delta.times if delta.finish_reason is not None else self._times_so_far()
            return delta.finish_reason is None
        if delta.finish_reason is not None:
            self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason
            self.times = delta.times
        return False

    def _times_so_far(self) -> RequestTimes | None:
        """The core's times at the first token, extended to now by this clock (a stop string ends the
        request here, before the core knows)."""
        first = self._first_times
        if first is None:
            return None
        decode = first.decode + time.monotonic() - self._first_seen
        return dataclasses.replace(first, decode=decode, inference=first.prefill + decode)

    def take(self) -> CompletionOutput:
        """This child's completion with only the news since the last call."""
        finished = self.finish_reason is not None
        text = self.detokenizer.get_next_output_text(finished, delta=True) if self.detokenizer else ""
        completion = CompletionOutput(
            index=self.index,
            text=text,
            token_ids=self.new_token_ids,
            cumulative_logprob=self.cumulative_logprob,
            logprobs=self.new_logprobs if self.logprobs else None,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            times=self.times if finished else None,
        )
        self.new_token_ids, self.new_logprobs = [], []
        self.done = finished
        return completion


class RequestProcessor:
    """One user request in the front end: its core requests out, its deltas in."""

    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        adapter: str | None,
        tokenizer,
        eos_token_ids: list[int],
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.adapter = adapter
        self.error: str | None = None
        self.error_code: str | None = None
        self.num_cached_tokens = 0
        # The first child's prompt logprobs, until the delta that carries them out (once).
        self._prompt_logprobs: list[PromptTokenLogprobs | None] | None = None
        self.child_ids = [request_id] if params.n == 1 else [f"{request_id}#{i}" for i in range(params.n)]
        # The core applies the same rule (child_params is idempotent on a child), so both sides agree on
        # which ids are stop tokens (their text is never added).
        self._child_params = [child_params(params, i, eos_token_ids) for i in range(params.n)]
        eos_token_id = eos_token_ids[0] if eos_token_ids else None
        self._children: dict[str, _Child] = {}
        for index, (child_id, params_i) in enumerate(zip(self.child_ids, self._child_params)):
            detokenizer = None
            if tokenizer is not None and prompt_token_ids:
                request = Request(child_id, prompt_token_ids, params_i, eos_token_id=eos_token_id)
                detokenizer = IncrementalDetokenizer(tokenizer, request)
            self._children[child_id] = _Child(index, detokenizer, params.logprobs is not None)

    def add_requests(self, meta: RequestMeta) -> list[AddRequest]:
        return [
            AddRequest(
                child_id,
                self.prompt_token_ids,
                dataclasses.replace(params, stop=[]),
                self.adapter,
                meta=meta,
            )
            for child_id, params in zip(self.child_ids, self._child_params)
        ]

    @property
    def finished(self) -> bool:
        return all(child.finish_reason is not None for child in self._children.values())

    @property
    def unfinished_child_ids(self) -> list[str]:
        return [i for i, child in self._children.items() if child.finish_reason is None]

    def process(self, deltas: list[RequestDelta]) -> tuple[RequestOutput | None, list[str]]:
        """(the merged delta, or None if nothing was new; the child ids a stop string ended, to abort)."""
        to_abort = []
        for delta in deltas:
            child = self._children.get(delta.request_id)
            if child is None or child.finish_reason is not None:
                continue  # e.g. the core's "abort" after a stop string ended it here
            if delta.error and self.error is None:
                self.error, self.error_code = delta.error, delta.error_code
            if child.index == 0:  # the prompt is counted once, as the first completion's (as vLLM's usage)
                self.num_cached_tokens = delta.num_cached_tokens
                if delta.prompt_logprobs is not None:
                    self._prompt_logprobs = delta.prompt_logprobs
            if child.apply(delta):
                to_abort.append(delta.request_id)
        published = [child for child in self._children.values() if child.published and not child.done]
        if not published:
            return None, to_abort
        return self._output([child.take() for child in published]), to_abort

    def fail(self, message: str) -> RequestOutput:
        """The final delta of a request refused before it reached the core."""
        self.error = message
        for child in self._children.values():
            child.published, child.finish_reason = True, RequestStatus.FINISHED_ERROR.finish_reason
        return self._output([child.take() for child in self._children.values()])

    def _output(self, completions: list[CompletionOutput]) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=completions,
            finished=self.finished,
            adapter=self.adapter,
            error=self.error,
            num_cached_tokens=self.num_cached_tokens,
            prompt_logprobs=self._take_prompt_logprobs(),
            error_code=self.error_code,
        )

    def _take_prompt_logprobs(self) -> list[PromptTokenLogprobs | None] | None:
        taken, self._prompt_logprobs = self._prompt_logprobs, None
        return taken
