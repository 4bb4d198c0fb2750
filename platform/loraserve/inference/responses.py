"""Engine deltas -> OpenAI bodies: whole responses, and the chunks of a stream.

Choice indices follow OpenAI: prompt `p`'s completion `i` is choice `p * n + i`.

Most chunks of a stream only add text to a choice that has started: for those, `plain_text_event`
fills the text into the chunk's JSON encoded once per choice (a template cut around a marker), byte for
byte what building the chunk and encoding it would give, without building it.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

import msgspec
from msgspec import UNSET, UnsetType

from engine import CompletionOutput, RequestOutput
from engine.sampler import TokenLogprobs
from loraserve.inference.logprobs import (
    TokenText,
    chat_logprobs,
    completion_logprobs,
    prompt_logprobs_body,
)
from loraserve.inference.schemas import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    Completion,
    CompletionChoice,
    PromptLogprobs,
    PromptTokensDetails,
    Usage,
)
from loraserve.inference.tools import ToolOutput
from loraserve.inference.tools import finish_reason as tool_finish_reason

_FINISH_REASONS = {"stop": "stop", "length": "length"}
# Stands for a chunk's text while its template is encoded; never part of real text (a NUL and a name).
_TEXT_MARKER = "\x00loraserve-text\x00"
SSE_PREFIX = b"data: "
SSE_SUFFIX = b"\n\n"


def sse_event(chunk: object) -> bytes:
    return SSE_PREFIX + msgspec.json.encode(chunk) + SSE_SUFFIX


def finish_reason(reason: str | None) -> str | None:
    return None if reason is None else _FINISH_REASONS.get(reason, reason)


@dataclass
class Choice:
    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    num_tokens: int = 0
    num_chars: int = 0  # streamed so far, for completions' text_offset
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # vLLM's: the stop string or stop token id that ended it
    started: bool = False  # a choice's first chunk carries the echo (and in completions the prompt's ids)
    opened: bool = False  # chat: the role-only chunk that opens a choice has gone out
    token_ids: list[int] = field(default_factory=list)  # kept only with return_token_ids


@dataclass(frozen=True)
class ResponseOptions:
    """What a request asked to see besides the generated text."""

    want_logprobs: bool = False
    return_token_ids: bool = False
    prompts: list[list[int]] = field(default_factory=list)  # prompt token ids, by prompt index
    echo: list[str] | None = None  # text repeated before each prompt's completions (echo)
    prompt_logprobs: bool = False  # vLLM's prompt_logprobs in the answer (completions: per choice)
    echo_logprobs: bool = False  # completions' echo with logprobs: the prompt's tokens lead each choice's
    tools: ToolOutput | None = None  # chat with tools: the text is read into content and tool_calls


class Choices:
    """Everything generated so far, per choice."""

    def __init__(
        self,
        n: int,
        want_logprobs: bool = False,
        keep_token_ids: bool = False,
        drop_generated: bool = False,
        cached_tokens_details: bool = False,
    ) -> None:
        self.n = n
        # --enable-prompt-tokens-details: usage.prompt_tokens_details.cached_tokens; off: null (vLLM's)
        self.cached_tokens_details = cached_tokens_details
        self.want_logprobs = want_logprobs  # then every new token is worth a chunk, text or not
        self.keep_token_ids = keep_token_ids
        # echo with max_tokens 0: the engine's one sampled token is no part of the answer (nor of usage)
        self.drop_generated = drop_generated
        self.by_index: dict[int, Choice] = {}
        self.cached_tokens: dict[int, int] = {}  # prompt index -> prompt tokens served from the prefix cache
        self.prompt_logprobs: dict[int, list] = {}  # prompt index -> its engine prompt logprob entries

    def add(self, prompt_index: int, delta: RequestOutput) -> list[tuple[int, CompletionOutput]]:
        """Record one delta; returns (choice index, completion delta) for the parts worth sending."""
        changed = []
        self.cached_tokens[prompt_index] = max(
            self.cached_tokens.get(prompt_index, 0), delta.num_cached_tokens
        )
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs[prompt_index] = delta.prompt_logprobs
        for completion in delta.outputs:
            if self.drop_generated:
                completion = dataclasses.replace(completion, text="", token_ids=[], logprobs=None)
            index = prompt_index * self.n + completion.index
            choice = self.by_index.setdefault(index, Choice())
            choice.text.append(completion.text)
            choice.logprobs.extend(completion.logprobs or [])
            choice.num_tokens += len(completion.token_ids)
            if self.keep_token_ids:
                choice.token_ids.extend(completion.token_ids)
            choice.finish_reason = finish_reason(completion.finish_reason)
            choice.stop_reason = completion.stop_reason
            # tokens without text yet (part of a character) still go out when their logprobs or ids
            # were asked for: otherwise the stream's ids or logprobs would miss them
            has_tokens = (self.want_logprobs or self.keep_token_ids) and completion.token_ids
            if completion.text or has_tokens or completion.finish_reason:
                changed.append((index, completion))
        return changed

    def usage(self, num_prompt_tokens: int, not_counting: int = 0) -> Usage:
        """Usage so far; `not_counting`: tokens of the delta being sent, left out of a chunk that opens it."""
        generated = sum(c.num_tokens for c in self.by_index.values()) - not_counting
        details = PromptTokensDetails(cached_tokens=sum(self.cached_tokens.values()))
        return Usage(
            prompt_tokens=num_prompt_tokens,
            completion_tokens=generated,
            total_tokens=num_prompt_tokens + generated,
            prompt_tokens_details=details if self.cached_tokens_details else None,
        )

    def sorted(self) -> list[tuple[int, Choice]]:
        return sorted(self.by_index.items())


class _Format:
    def __init__(self, response_id: str, model: str, text: TokenText, options: ResponseOptions) -> None:
        self.id, self.model, self.text, self.options = response_id, model, text, options
        self.created = int(time.time())
        self._prompt_bodies: dict[int, PromptLogprobs] = {}  # by prompt: its choices share one
        self._templates: dict[int, tuple[bytes, bytes]] = {}  # by choice: the plain chunk around its text

    def plain_text_event(self, choices: Choices, index: int, completion: CompletionOutput) -> bytes | None:
        """The SSE event of a chunk that only adds text to choice `index`, already started (no logprobs,
        token ids, finish reason or usage): the same bytes as `sse_event(self.chunk(...))`. None for any
        other chunk. A format whose chunks carry more (tool calls, say) must return None for those."""
        choice = choices.by_index[index]
        if (
            not choice.started
            or self.want_logprobs
            or self.options.return_token_ids
            or self.options.tools is not None  # a tool parser reads every delta (it may hold text back)
            or completion.finish_reason is not None
        ):
            return None
        template = self._templates.get(index)
        if template is None:
            head, _, tail = sse_event(self._plain_chunk(index, _TEXT_MARKER)).partition(
                msgspec.json.encode(_TEXT_MARKER)
            )
            template = self._templates[index] = (head, tail)
        choice.num_chars += len(completion.text)
        return template[0] + msgspec.json.encode(completion.text) + template[1]

    def _plain_chunk(self, index: int, text: str):
        """What `chunk` builds for a plain text delta of a started choice."""
        raise NotImplementedError

    @property
    def want_logprobs(self) -> bool:
        return self.options.want_logprobs

    def _echo(self, choices: Choices, index: int) -> str:
        echo = self.options.echo
        return echo[index // choices.n] if echo else ""

    def _prompt_ids(self, choices: Choices, index: int, absent: None | UnsetType = UNSET):
        """With return_token_ids the prompt's ids; else `absent`: None in whole answers (vLLM's null),
        UNSET (left out) in stream chunks."""
        return self.options.prompts[index // choices.n] if self.options.return_token_ids else absent

    def _ids(self, token_ids: list[int], absent: None | UnsetType = UNSET):
        return list(token_ids) if self.options.return_token_ids else absent

    def _prompt_logprobs(self, choices: Choices, index: int) -> PromptLogprobs | None:
        if not self.options.prompt_logprobs:
            return None
        prompt = index // choices.n
        if prompt not in self._prompt_bodies:
            self._prompt_bodies[prompt] = prompt_logprobs_body(
                choices.prompt_logprobs.get(prompt, []), self.text
            )
        return self._prompt_bodies[prompt]

    def _echoed(self, choices: Choices, index: int):
        """The prompt's ids and logprob entries that lead a choice's logprobs (echo with logprobs)."""
        if not self.options.echo_logprobs:
            return None
        prompt = index // choices.n
        return self.options.prompts[prompt], choices.prompt_logprobs.get(prompt, [])


class CompletionFormat(_Format):
    """`text_completion` objects, whole or as stream chunks."""

    def whole(self, choices: Choices, usage: Usage) -> Completion:
        items = [
            CompletionChoice(
                index=index,
                text=self._echo(choices, index) + "".join(choice.text),
                logprobs=(
                    completion_logprobs(choice.logprobs, self.text, prompt=self._echoed(choices, index))
                    if self.want_logprobs
                    else None
                ),
                finish_reason=choice.finish_reason,
                stop_reason=choice.stop_reason,
                prompt_token_ids=self._prompt_ids(choices, index, None),
                token_ids=self._ids(choice.token_ids, None),
                prompt_logprobs=self._prompt_logprobs(choices, index),
            )
            for index, choice in choices.sorted()
        ]
        return Completion(id=self.id, created=self.created, model=self.model, choices=items, usage=usage)

    def chunk(
        self, choices: Choices, changed: list[tuple[int, CompletionOutput]], usage: Usage | None = None
    ) -> Completion:
        items = []
        for index, completion in changed:
            choice = choices.by_index[index]
            first = not choice.started
            choice.started = True
            logprobs = None
            if self.want_logprobs:
                offset = choice.num_chars
                echoed = self._echoed(choices, index) if first else None
                logprobs = completion_logprobs(completion.logprobs or [], self.text, offset, echoed)
            text = (self._echo(choices, index) if first else "") + completion.text
            choice.num_chars += len(text)
            items.append(
                CompletionChoice(
                    index=index,
                    text=text,
                    logprobs=logprobs,
                    finish_reason=finish_reason(completion.finish_reason),
                    stop_reason=completion.stop_reason,
                    prompt_token_ids=self._prompt_ids(choices, index) if first else UNSET,
                    token_ids=self._ids(completion.token_ids),
                )
            )
        return Completion(id=self.id, created=self.created, model=self.model, choices=items, usage=usage)

    def usage_chunk(self, usage: Usage) -> Completion:
        return Completion(id=self.id, created=self.created, model=self.model, choices=[], usage=usage)

    def _plain_chunk(self, index: int, text: str) -> Completion:
        choice = CompletionChoice(index=index, text=text, logprobs=None, finish_reason=None, stop_reason=None)
        return Completion(id=self.id, created=self.created, model=self.model, choices=[choice], usage=None)


class ChatFormat(_Format):
    """`chat.completion` objects and `chat.completion.chunk` stream chunks."""

    def whole(self, choices: Choices, usage: Usage) -> ChatCompletion:
        items = [
            ChatChoice(
                index=index,
                message=message,
                logprobs=chat_logprobs(choice.logprobs, self.text) if self.want_logprobs else None,
                finish_reason=tool_finish_reason(choice.finish_reason, bool(message.tool_calls)),
                stop_reason=choice.stop_reason,
                token_ids=self._ids(choice.token_ids, None),
            )
            for index, choice in choices.sorted()
            for message in [self._message(choices, index, choice)]
        ]
        return ChatCompletion(
            id=self.id,
            created=self.created,
            model=self.model,
            choices=items,
            usage=usage,
            prompt_token_ids=self._prompt_ids(choices, 0, None),
            prompt_logprobs=self._prompt_logprobs(choices, 0),
        )

    def _message(self, choices: Choices, index: int, choice: Choice) -> AssistantMessage:
        text = "".join(choice.text)
        tools = self.options.tools
        if tools is None:
            return AssistantMessage(content=self._echo(choices, index) + text)
        content, calls = tools.message(text)
        if content is not None:
            content = self._echo(choices, index) + content
        return AssistantMessage(content=content, tool_calls=calls or UNSET)

    def chunk(
        self, choices: Choices, changed: list[tuple[int, CompletionOutput]], usage: Usage | None = None
    ) -> ChatCompletionChunk | None:
        """The chunk of these choices' deltas; None when there is nothing to send (text a tool parser
        holds back until it knows whether it is a call)."""
        items = []
        tools = self.options.tools
        for index, completion in changed:
            choice = choices.by_index[index]
            first = not choice.started
            logprobs = chat_logprobs(completion.logprobs or [], self.text) if self.want_logprobs else None
            text, tool_calls, finish = completion.text, None, finish_reason(completion.finish_reason)
            if tools is not None:
                content, deltas = tools.delta(index, text, finish is not None)
                text, tool_calls = content or "", deltas or None
                finish = tool_finish_reason(finish, tools.streamed_calls(index))
                if not (first or text or tool_calls or finish or logprobs or self.options.return_token_ids):
                    continue
            choice.started = True
            text = (self._echo(choices, index) if first else "") + text
            delta = ChatDelta(content=text or None, tool_calls=tool_calls)
            items.append(
                ChatChunkChoice(
                    index=index,
                    delta=delta,
                    logprobs=logprobs,
                    finish_reason=finish,
                    stop_reason=completion.stop_reason,
                    token_ids=self._ids(completion.token_ids),
                )
            )
        if not items:
            return None
        return ChatCompletionChunk(
            id=self.id, created=self.created, model=self.model, choices=items, usage=usage
        )

    def opening(self, choices: Choices, index: int, usage: Usage | None = None) -> ChatCompletionChunk:
        """A choice's first chunk, as OpenAI and vLLM send it: the role alone (content ""), with the
        prompt's token ids when asked for; its text follows in the next chunks."""
        opening = ChatChunkChoice(index=index, delta=ChatDelta(role="assistant", content=""))
        return ChatCompletionChunk(
            id=self.id,
            created=self.created,
            model=self.model,
            choices=[opening],
            usage=usage,
            prompt_token_ids=self._prompt_ids(choices, index),
        )

    def usage_chunk(self, usage: Usage) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=self.id, created=self.created, model=self.model, choices=[], usage=usage
        )

    def _plain_chunk(self, index: int, text: str) -> ChatCompletionChunk:
        choice = ChatChunkChoice(
            index=index, delta=ChatDelta(content=text), logprobs=None, finish_reason=None, stop_reason=None
        )
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=[choice])
