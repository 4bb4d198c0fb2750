"""A stream's text-only chunks come from a template encoded once per choice: byte for byte the event that
building the chunk and encoding it gives, for any text (quotes, escapes, NUL, emoji), both formats, any
choice; every other chunk (first, logprobs, token ids, finish) is built as before."""

from __future__ import annotations

import random

import pytest
from loraserve.inference.logprobs import TokenText
from loraserve.inference.responses import ChatFormat, Choices, CompletionFormat, ResponseOptions, sse_event

from engine import CompletionOutput, RequestOutput

TEXTS = ["hello", ' "quoted" \\ back', "\x00\x1f\n\t", "😀 你好 é", "</script>", "\u2028", " "]


def delta(index: int, text: str, finish_reason: str | None = None) -> RequestOutput:
    completion = CompletionOutput(
        index=index,
        text=text,
        token_ids=[7],
        cumulative_logprob=None,
        logprobs=None,
        finish_reason=finish_reason,
    )
    return RequestOutput(
        request_id="r", prompt=None, prompt_token_ids=[1], outputs=[completion], finished=False
    )


@pytest.mark.parametrize("format_type", [CompletionFormat, ChatFormat])
@pytest.mark.parametrize("n", [1, 3])
def test_text_only_chunks_from_the_template_equal_the_built_ones(format_type, n):
    rng = random.Random(n)
    options = ResponseOptions(prompts=[[1]])
    fast, built = (format_type("cmpl-x", "tiny@2", TokenText(None, False), options) for _ in range(2))
    fast.created = built.created
    fast_choices, built_choices = Choices(n), Choices(n)
    from_template = 0
    for step in range(40):
        index = rng.randrange(n)
        text = rng.choice(TEXTS) + rng.choice(TEXTS)
        (item,) = fast_choices.add(0, delta(index, text))
        built_choices.add(0, delta(index, text))
        event = fast.plain_text_event(fast_choices, *item)
        expected = sse_event(built.chunk(built_choices, [item]))
        if event is None:  # a choice's first chunk (role, echo) is built
            event = sse_event(fast.chunk(fast_choices, [item]))
        else:
            from_template += 1
        assert event == expected, (step, text)
    assert from_template >= 40 - n  # all but each choice's first


def test_chunks_that_carry_more_than_text_are_built():
    options = ResponseOptions(prompts=[[1]], want_logprobs=True)
    fmt = ChatFormat("chatcmpl-x", "tiny", TokenText(None, False), options)
    choices = Choices(1, want_logprobs=True)
    fmt.chunk(choices, choices.add(0, delta(0, "first")))  # started
    assert fmt.plain_text_event(choices, *choices.add(0, delta(0, "more"))[0]) is None  # logprobs wanted
    plain = ChatFormat("chatcmpl-x", "tiny", TokenText(None, False), ResponseOptions(prompts=[[1]]))
    choices = Choices(1)
    plain.chunk(choices, choices.add(0, delta(0, "first")))
    assert plain.plain_text_event(choices, *choices.add(0, delta(0, "end", "stop"))[0]) is None
