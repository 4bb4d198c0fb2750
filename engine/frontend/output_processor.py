"""The front end's half of a request: text, stop strings, logprobs and the `n > 1` fan-in.

The one output path: both front ends use it, AsyncLLM (the server's, one RequestProcessor per stream)
and LLMEngine (in the caller's process, through OutputProcessor); the engine core only sends token
deltas (engine.messages.RequestDelta).

A user request with `n` completions is `n` core requests ("children", ids `child_request_ids`, each
seeded `seed + i` as vLLM does). The core sends each child's new token ids; here they become text
(IncrementalDetokenizer), a stop string ends a child (and the caller aborts it in the core), the
cumulative logprob is summed, the first child's prompt logprobs go out once, and the children's news of
one message merge into one RequestOutput: with delta outputs, each completion published so far and not
yet finished in an earlier output, holding only what is new since then; with cumulative outputs, every
completion published so far, holding everything.

By vLLM's convention a stop token stays in `token_ids` but adds no text; the detokenizer knows the stop
tokens from the child's params (engine.core.request_checks.child_params).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

from engine.core.request_checks import RequestError, child_params
from engine.detokenizer import IncrementalDetokenizer
from engine.messages import AddRequest, RequestDelta
from engine.outputs import CompletionOutput, RequestOutput, RequestTimes
from engine.prompt_logprobs import PromptTokenLogprobs
from engine.request import Request, RequestStatus
from engine.request_meta import RequestMeta
from engine.sampler import TokenLogprobs
from engine.sampling_params import SamplingParams

_STOP = RequestStatus.FINISHED_STOPPED.finish_reason
Prompt = str | list[int]


def child_request_ids(request_id: str, n: int) -> list[str]:
    """The core request ids of a user request's `n` completions: its own id when n == 1, else `id#i`."""
    return [request_id] if n == 1 else [f"{request_id}#{i}" for i in range(n)]


@dataclass
class _Child:
    index: int
    detokenizer: IncrementalDetokenizer | None
    logprobs: bool
    cumulative: bool = False  # each output holds everything so far, not only what is new
    published: bool = False  # appeared in a delta: from then on it is part of the request's outputs
    done: bool = False  # its final completion went out: later deltas leave it out
    last: CompletionOutput | None = None  # what take() gave last
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    times: RequestTimes | None = None  # once finished
    _first_times: RequestTimes | None = None  # the core's, at the first token, and when they arrived
    _first_seen: float = 0.0
    # Everything so far (cumulative), else the news since the last output.
    token_ids: list[int] = field(default_factory=list)
    token_logprobs: list[TokenLogprobs] = field(default_factory=list)

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
        self.token_ids.extend(ids)
        for item in (delta.logprobs or ())[: len(ids)]:
            self.token_logprobs.append(item)
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
        """This child's completion: everything so far (cumulative), else the news since the last call."""
        finished = self.finish_reason is not None
        delta = not self.cumulative
        text = self.detokenizer.get_next_output_text(finished, delta=delta) if self.detokenizer else ""
        # a delta hands its lists over (fresh ones follow); cumulative outputs each get a copy
        token_ids = self.token_ids if delta else list(self.token_ids)
        token_logprobs = self.token_logprobs if delta else list(self.token_logprobs)
        completion = CompletionOutput(
            index=self.index,
            text=text,
            token_ids=token_ids,
            cumulative_logprob=self.cumulative_logprob,
            logprobs=token_logprobs if self.logprobs else None,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            times=self.times if finished else None,
        )
        if delta:  # what went out is not kept: a stream's state stays small at any length
            self.token_ids, self.token_logprobs = [], []
        self.done = finished
        self.last = completion
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
        cumulative: bool = False,
    ) -> None:
        """`cumulative`: each output holds every completion so far, whole (LLMEngine's default);
        otherwise only what is new since the previous output (AsyncLLM's streams)."""
        self.request_id = request_id
        self.cumulative = cumulative
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.adapter = adapter
        self.error: str | None = None
        self.error_code: str | None = None
        self.num_cached_tokens = 0
        # The first child's prompt logprobs, until the delta that carries them out (once).
        self._prompt_logprobs: list[PromptTokenLogprobs | None] | None = None
        self.child_ids = child_request_ids(request_id, params.n)
        # Why the request cannot go to the core (its params, changed after they were checked, are
        # refused by the children's own checks), else None.
        self.invalid: str | None = None
        try:
            self._child_params = [child_params(params, i, eos_token_ids) for i in range(params.n)]
        except ValueError as exc:
            self._child_params, self.invalid = [params] * params.n, str(exc)
        eos_token_id = eos_token_ids[0] if eos_token_ids else None
        self._children: dict[str, _Child] = {}
        for index, (child_id, params_i) in enumerate(zip(self.child_ids, self._child_params)):
            detokenizer = None
            if tokenizer is not None and prompt_token_ids:
                request = Request(child_id, prompt_token_ids, params_i, eos_token_id=eos_token_id)
                detokenizer = IncrementalDetokenizer(tokenizer, request)
            self._children[child_id] = _Child(index, detokenizer, params.logprobs is not None, cumulative)

    def add_requests(self, meta: RequestMeta) -> list[AddRequest]:
        return [
            AddRequest(
                child_id,
                self.prompt_token_ids,
                dataclasses.replace(params, stop=[]),
                self.adapter,
                meta=meta,
                counts_prompt=index == 0,  # the prompt is counted once, as the first completion's
            )
            for index, (child_id, params) in enumerate(zip(self.child_ids, self._child_params))
        ]

    @property
    def finished(self) -> bool:
        return all(child.finish_reason is not None for child in self._children.values())

    @property
    def unfinished_child_ids(self) -> list[str]:
        return [i for i, child in self._children.items() if child.finish_reason is None]

    def process(self, deltas: list[RequestDelta]) -> tuple[RequestOutput | None, list[str]]:
        """(the merged output, or None if nothing was new; the child ids a stop string ended, to abort)."""
        to_abort = []
        applied: set[int] = set()  # the indices of the children this call changed
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
            applied.add(child.index)
            if child.apply(delta):
                to_abort.append(delta.request_id)
        if self.cumulative:
            published = [child for child in self._children.values() if child.published]
            if not applied:
                return None, to_abort
        else:
            published = [child for child in self._children.values() if child.published and not child.done]
        if not published:
            return None, to_abort
        # cumulative: a child this call did not change gives its last completion again, not a new copy
        completions = [
            child.last if self.cumulative and child.index not in applied and child.last else child.take()
            for child in published
        ]
        return self._output(completions), to_abort

    def fail(self, message: str, error_code: str | None = None) -> RequestOutput:
        """The final output of a request refused before it reached the core."""
        self.error, self.error_code = message, error_code
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
        """With delta outputs they go out once; cumulative outputs carry them from then on."""
        taken = self._prompt_logprobs
        if not self.cumulative:
            self._prompt_logprobs = None
        return taken


def new_request(
    request_id: str,
    prompt: Prompt,
    params: SamplingParams,
    adapter: str | None,
    tokenizer,
    eos_token_ids: list[int],
    cumulative: bool = False,
    detokenize: bool = True,
) -> tuple[RequestProcessor, RequestOutput | None]:
    """A user request's processor (its text prompt tokenized), and its final output if it cannot go to
    the core (a text prompt without a tokenizer), else None. `detokenize=False`: token ids only, no
    text and no stop strings."""
    text, ids = (prompt, None) if isinstance(prompt, str) else (None, list(prompt))
    if ids is None and tokenizer is not None:
        ids = tokenizer(text).input_ids
    detokenizer = tokenizer if detokenize else None
    request = RequestProcessor(
        request_id, text, ids or [], params, adapter, detokenizer, eos_token_ids, cumulative
    )
    if ids is None:
        return request, request.fail(
            "this engine has no tokenizer: pass prompts as token ids", RequestError.code
        )
    if request.invalid is not None:
        return request, request.fail(request.invalid, RequestError.code)
    return request, None


class OutputProcessor:
    """Many user requests at once, in the caller's process (LLMEngine's front half): a step's deltas in,
    one RequestOutput per user request that changed out."""

    def __init__(self) -> None:
        self._requests: dict[str, RequestProcessor] = {}  # user request id -> its processor
        self._by_child: dict[str, RequestProcessor] = {}  # core request id -> its user request's
        self._failed: list[RequestOutput] = []  # refused before the core, returned with the next step

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    @property
    def has_pending(self) -> bool:
        return bool(self._failed)

    def add(self, request: RequestProcessor, failed: RequestOutput | None = None) -> None:
        """Track a request sent to the core, or keep the final output of one that never reaches it.
        ValueError for an id in use, also as another request's child id (`x#0` beside `x` with n > 1)."""
        in_use = request.request_id in self._requests or any(c in self._by_child for c in request.child_ids)
        if in_use:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if failed is not None:
            self._failed.append(failed)
            return
        self._requests[request.request_id] = request
        for child_id in request.child_ids:
            self._by_child[child_id] = request

    def child_ids(self, request_ids: list[str]) -> list[str]:
        """The unfinished core requests of these user requests (unknown ids have none)."""
        return [c for r in request_ids if r in self._requests for c in self._requests[r].unfinished_child_ids]

    def process(self, deltas: list[RequestDelta]) -> tuple[list[RequestOutput], list[str]]:
        """(one output per user request the deltas changed, the core requests to abort: ended by a stop
        string here)."""
        outputs, self._failed = self._failed, []
        grouped: dict[str, list[RequestDelta]] = {}
        for delta in deltas:
            request = self._by_child.get(delta.request_id)
            if request is not None:  # else it ended here already (a stop string): the core's late news
                grouped.setdefault(request.request_id, []).append(delta)
        to_abort: list[str] = []
        for request_id, request_deltas in grouped.items():
            request = self._requests[request_id]
            output, ended = request.process(request_deltas)
            to_abort.extend(ended)
            if output is not None:
                outputs.append(output)
            if request.finished:
                del self._requests[request_id]
                for child_id in request.child_ids:
                    self._by_child.pop(child_id, None)
        return outputs, to_abort
