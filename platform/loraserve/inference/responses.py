"""Engine deltas -> OpenAI bodies: whole responses, and the chunks of a stream.

Choice indices follow OpenAI: prompt `p`'s completion `i` is choice `p * n + i`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

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
    started: bool = False  # a choice's first chunk carries the role (chat), the echo and the prompt's ids
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

    def __init__(self, n: int, want_logprobs: bool = False, keep_token_ids: bool = False) -> None:
        self.n = n
        self.want_logprobs = want_logprobs  # then every new token is worth a chunk, text or not
        self.keep_token_ids = keep_token_ids
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
            index = prompt_index * self.n + completion.index
            choice = self.by_index.setdefault(index, Choice())
            choice.text.append(completion.text)
            choice.logprobs.extend(completion.logprobs or [])
            choice.num_tokens += len(completion.token_ids)
            if self.keep_token_ids:
                choice.token_ids.extend(completion.token_ids)
            choice.finish_reason = finish_reason(completion.finish_reason)
            choice.stop_reason = completion.stop_reason
            has_logprobs = self.want_logprobs and completion.token_ids
            if completion.text or has_logprobs or completion.finish_reason:
                changed.append((index, completion))
        return changed

    def usage(self, num_prompt_tokens: int) -> Usage:
        generated = sum(c.num_tokens for c in self.by_index.values())
        return Usage(
            prompt_tokens=num_prompt_tokens,
            completion_tokens=generated,
            total_tokens=num_prompt_tokens + generated,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(self.cached_tokens.values())),
        )

    def sorted(self) -> list[tuple[int, Choice]]:
        return sorted(self.by_index.items())


class _Format:
    def __init__(self, response_id: str, model: str, text: TokenText, options: ResponseOptions) -> None:
        self.id, self.model, self.text, self.options = response_id, model, text, options
        self.created = int(time.time())
        self._prompt_bodies: dict[int, PromptLogprobs] = {}  # by prompt: its choices share one

    @property
    def want_logprobs(self) -> bool:
        return self.options.want_logprobs

    def _echo(self, choices: Choices, index: int) -> str:
        echo = self.options.echo
        return echo[index // choices.n] if echo else ""

    def _prompt_ids(self, choices: Choices, index: int) -> list[int] | UnsetType:
        return self.options.prompts[index // choices.n] if self.options.return_token_ids else UNSET

    def _ids(self, token_ids: list[int]) -> list[int] | UnsetType:
        return list(token_ids) if self.options.return_token_ids else UNSET

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
                prompt_token_ids=self._prompt_ids(choices, index),
                token_ids=self._ids(choice.token_ids),
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
                token_ids=self._ids(choice.token_ids),
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
            prompt_token_ids=self._prompt_ids(choices, 0),
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
        prompt_ids: list[int] | UnsetType = UNSET
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
            role = "assistant" if first else None
            if first:
                prompt_ids = self._prompt_ids(choices, index)
            text = (self._echo(choices, index) if first else "") + text
            delta = ChatDelta(role=role, content=text if text or role else None, tool_calls=tool_calls)
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
            id=self.id,
            created=self.created,
            model=self.model,
            choices=items,
            usage=usage,
            prompt_token_ids=prompt_ids,
        )

    def usage_chunk(self, usage: Usage) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=self.id, created=self.created, model=self.model, choices=[], usage=usage
        )
