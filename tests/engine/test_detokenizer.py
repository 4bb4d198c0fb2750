"""IncrementalDetokenizer: whole characters, prompt context, special and stop tokens, stop strings, hold-back."""

from __future__ import annotations

import pytest
from tokenizer_fixtures import ALL_TOKENIZERS, CORPUS, MULTI_BYTE_SAMPLES, byte_level_bpe_tokenizer

from engine.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer, find_stop_string
from engine.request import Request
from engine.sampling_params import SamplingParams

STOP_TEXT = "stop here. STOP there. The end."
BOS = 1  # both fixture tokenizers' bos token: special, so skipped text by default
PROMPT = [BOS]
BOUNDARY_TEXT = "Hello world! The quick café 😀 fox jumps over 你好 the lazy dog."
CJK_TEXT = "你好世界，今天天气很好。"


@pytest.fixture(params=sorted(ALL_TOKENIZERS))
def tokenizer(request):
    return ALL_TOKENIZERS[request.param]()


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def decode(tokenizer, token_ids: list[int], skip_special_tokens: bool = True) -> str:
    return tokenizer.decode(
        token_ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
    )


def continuation(
    tokenizer, prompt_ids: list[int], output_ids: list[int], skip_special_tokens: bool = True
) -> str:
    """What the output adds to the prompt's text: the detokenizer's target."""
    prompt_text = decode(tokenizer, prompt_ids, skip_special_tokens)
    full_text = decode(tokenizer, prompt_ids + output_ids, skip_special_tokens)
    assert full_text.startswith(prompt_text)
    return full_text[len(prompt_text) :]


def make_detokenizer(tokenizer, prompt_ids=None, **params) -> IncrementalDetokenizer:
    request = Request(
        "r",
        prompt_ids or list(PROMPT),
        SamplingParams(max_tokens=None, **params),
        eos_token_id=tokenizer.eos_token_id,
    )
    return IncrementalDetokenizer(tokenizer, request)


def stream(detokenizer: IncrementalDetokenizer, token_ids: list[int]) -> list[str]:
    """Feed tokens one at a time; return the delta streamed after each (unfinished)."""
    deltas = []
    for token_id in token_ids:
        detokenizer.update([token_id])
        deltas.append(detokenizer.get_next_output_text(finished=False, delta=True))
    return deltas


@pytest.mark.parametrize("text", MULTI_BYTE_SAMPLES + [" ".join(CORPUS)])
def test_characters_come_out_whole_token_by_token(tokenizer, text):
    token_ids = encode(tokenizer, text)
    deltas = stream(make_detokenizer(tokenizer), token_ids)
    assert all(REPLACEMENT_CHAR not in delta for delta in deltas)
    assert "".join(deltas) == decode(tokenizer, token_ids) == continuation(tokenizer, PROMPT, token_ids)


def test_fixture_tokenizers_split_characters(tokenizer):
    """The tests above mean something only if characters really span several tokens."""
    split = [
        i
        for text in MULTI_BYTE_SAMPLES
        for i in encode(tokenizer, text)
        if REPLACEMENT_CHAR in decode(tokenizer, [i])
    ]
    assert len(split) >= 2


@pytest.mark.parametrize("text", [BOUNDARY_TEXT, CJK_TEXT])
def test_prompt_context(tokenizer, text):
    """prompt text + output text == text of all tokens, wherever the prompt ends.

    SentencePiece decoders strip the first token's space, and a context window that starts inside a
    character must not garble the output. Prompts that end inside a character are left out.
    """
    token_ids = encode(tokenizer, text)
    num_checked = 0
    for num_prompt_tokens in range(1, len(token_ids)):
        prompt_ids, output_ids = token_ids[:num_prompt_tokens], token_ids[num_prompt_tokens:]
        prompt_text = decode(tokenizer, prompt_ids)
        if prompt_text.endswith(REPLACEMENT_CHAR):
            continue
        detokenizer = make_detokenizer(tokenizer, prompt_ids)
        detokenizer.update(output_ids)
        assert prompt_text + detokenizer.output_text == text, f"prompt of {num_prompt_tokens} tokens"
        num_checked += 1
    assert num_checked >= 10


@pytest.mark.parametrize("skip_special_tokens", [True, False])
@pytest.mark.parametrize("prompt", [PROMPT, [7, 8], [BOS, 7]])
def test_special_tokens(tokenizer, skip_special_tokens, prompt):
    token_ids = encode(tokenizer, "ab") + [tokenizer.bos_token_id] + encode(tokenizer, " cd")
    detokenizer = make_detokenizer(tokenizer, prompt, skip_special_tokens=skip_special_tokens)
    deltas = stream(detokenizer, token_ids)
    expected = continuation(tokenizer, prompt, token_ids, skip_special_tokens)
    assert "".join(deltas) == detokenizer.output_text == expected
    assert ("<s>" in expected) is not skip_special_tokens


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_eos_text_is_never_output(tokenizer, skip_special_tokens):
    detokenizer = make_detokenizer(tokenizer, skip_special_tokens=skip_special_tokens)
    text_ids = encode(tokenizer, "the end")
    assert detokenizer.update(text_ids + [tokenizer.eos_token_id]) is None
    detokenizer.update(encode(tokenizer, " more"))
    assert detokenizer.output_text == continuation(tokenizer, PROMPT, text_ids, skip_special_tokens)
    assert detokenizer.stop_string is None


def test_eos_with_ignore_eos_is_text(tokenizer):
    detokenizer = make_detokenizer(tokenizer, ignore_eos=True, skip_special_tokens=False)
    token_ids = encode(tokenizer, "ab") + [tokenizer.eos_token_id] + encode(tokenizer, " cd")
    detokenizer.update(token_ids)
    assert detokenizer.output_text == continuation(tokenizer, PROMPT, token_ids, skip_special_tokens=False)
    assert "<|endoftext|>" in detokenizer.output_text


@pytest.mark.parametrize("min_tokens, expected", [(0, "a"), (1, "a"), (2, "a!b")])
def test_stop_token_id_text_is_dropped_after_min_tokens(min_tokens, expected):
    tokenizer = byte_level_bpe_tokenizer()
    (a,), (bang,), (b,) = encode(tokenizer, "a"), encode(tokenizer, "!"), encode(tokenizer, "b")
    detokenizer = make_detokenizer(tokenizer, stop_token_ids=[bang], min_tokens=min_tokens)
    detokenizer.update([a, bang, b])
    assert detokenizer.output_text == expected


STOP_CASES = [
    # (stop, include_stop_str_in_output, expected output_text, expected stop string)
    (["STOP"], False, "stop here. ", "STOP"),
    (["STOP"], True, "stop here. STOP", "STOP"),
    (["here. ST"], False, "stop ", "here. ST"),  # spans several tokens
    (["here. ST"], True, "stop here. ST", "here. ST"),  # the rest of the token "STOP" is cut
    (["end", "there"], False, "stop here. STOP ", "there"),  # the earliest match wins
    (["STOP t", "STOP"], False, "stop here. ", "STOP"),  # found before the longer one completes
    (["zzz"], False, STOP_TEXT, None),
    (["."], True, "stop here.", "."),
]


@pytest.mark.parametrize("stop, include, expected_text, expected_stop", STOP_CASES)
def test_stop_strings(tokenizer, stop, include, expected_text, expected_stop):
    detokenizer = make_detokenizer(tokenizer, stop=stop, include_stop_str_in_output=include)
    matches = [detokenizer.update([token_id]) for token_id in encode(tokenizer, STOP_TEXT)]
    assert [m for m in matches if m is not None] == ([expected_stop] if expected_stop else [])
    assert detokenizer.output_text == expected_text
    assert detokenizer.stop_string == expected_stop
    assert detokenizer.get_next_output_text(finished=True, delta=False) == expected_text


def test_stop_string_spans_tokens(tokenizer):
    assert not any("here. ST" in decode(tokenizer, [i]) for i in encode(tokenizer, STOP_TEXT))


@pytest.mark.parametrize(
    "text, stop, expected_text", [("café 😀 你好", ["😀"], "café "), ("café 😀 你好", ["好"], "café 😀 你")]
)
def test_multi_byte_stop_strings(tokenizer, text, stop, expected_text):
    detokenizer = make_detokenizer(tokenizer, stop=stop)
    stream(detokenizer, encode(tokenizer, text))
    assert detokenizer.output_text == expected_text


@pytest.mark.parametrize("min_tokens, expected_stop", [(0, "STOP"), (3, "STOP"), (100, None)])
def test_stop_strings_wait_for_min_tokens(min_tokens, expected_stop):
    tokenizer = byte_level_bpe_tokenizer()
    detokenizer = make_detokenizer(tokenizer, stop=["STOP"], min_tokens=min_tokens)
    stream(detokenizer, encode(tokenizer, STOP_TEXT))
    assert detokenizer.stop_string == expected_stop


@pytest.mark.parametrize(
    "stop, include, hold_back",
    [(["STOP there"], False, 9), (["x", "STOP"], False, 3), (["STOP there"], True, 0), ([], False, 0)],
)
def test_streaming_holds_back_a_possible_stop_string(tokenizer, stop, include, hold_back):
    detokenizer = make_detokenizer(tokenizer, stop=stop, include_stop_str_in_output=include)
    assert detokenizer.stop_buffer_length == hold_back
    streamed = ""
    for token_id in encode(tokenizer, STOP_TEXT):
        detokenizer.update([token_id])
        streamed += detokenizer.get_next_output_text(finished=False, delta=True)
        assert detokenizer.output_text.startswith(streamed)
        if detokenizer.stop_string is None:
            assert streamed == detokenizer.output_text[: max(len(detokenizer.output_text) - hold_back, 0)]
            assert detokenizer.get_next_output_text(finished=False, delta=False) == streamed
        if not include:
            assert not any(s in streamed for s in stop)
    streamed += detokenizer.get_next_output_text(finished=True, delta=True)
    assert streamed == detokenizer.output_text
    assert detokenizer.get_next_output_text(finished=True, delta=True) == ""


def test_incomplete_character_is_emitted_as_decoded(tokenizer):
    """A character cut short by the model shows as the decoder shows it once later text arrives."""
    token_ids = encode(tokenizer, "😀")[:-1] + encode(tokenizer, " ok")
    deltas = stream(make_detokenizer(tokenizer), token_ids)
    assert "".join(deltas) == continuation(tokenizer, PROMPT, token_ids)


def test_invalid_bytes_show_once_text_follows(tokenizer):
    token_ids = [encode(tokenizer, "😀")[-1]] * 5 + encode(tokenizer, " ok")
    detokenizer = make_detokenizer(tokenizer)
    stream(detokenizer, token_ids)
    assert detokenizer.output_text == continuation(tokenizer, PROMPT, token_ids)
    assert detokenizer.output_text.startswith(REPLACEMENT_CHAR)


def test_out_of_vocabulary_ids_decode_to_nothing(tokenizer):
    """Models often pad their vocabulary beyond the tokenizer's."""
    detokenizer = make_detokenizer(tokenizer)
    ab, cd = encode(tokenizer, "ab"), encode(tokenizer, "cd")
    detokenizer.update(ab + [len(tokenizer) + 100] + cd)
    assert detokenizer.output_text == continuation(tokenizer, PROMPT, ab + cd)


@pytest.mark.parametrize(
    "text, num_new_chars, stop, include, expected",
    [
        ("hello world", 5, ["world"], False, ("world", 6)),
        ("hello world", 5, ["world"], True, ("world", 11)),
        ("hello world", 1, ["lo w"], False, None),  # ended in text searched before
        ("hello world", 8, ["lo w"], False, ("lo w", 3)),
        ("hello world", 11, ["o", "l"], False, ("l", 2)),  # earliest match
        ("hello world", 11, ["ll", "l"], False, ("ll", 2)),  # same place: listed first
        ("hello world", 0, ["world"], False, None),
        ("hello", 5, [], False, None),
        ("abcab", 2, ["ab"], False, ("ab", 3)),  # only a match ending in the new text
    ],
)
def test_find_stop_string(text, num_new_chars, stop, include, expected):
    assert find_stop_string(text, num_new_chars, stop, include) == expected
