"""The Rust incremental decoder (`tokenizers`' DecodeStream) gives exactly the Python window's text, delta by
delta, on random token streams: multi-byte characters never split, special tokens skipped or kept, stop
tokens and stop strings, prompts ending inside a character. Tokenizers that are not plain fast tokenizers
keep the Python window."""

from __future__ import annotations

import random

import pytest
from tokenizer_fixtures import ALL_TOKENIZERS, CORPUS

from engine.detokenizer import IncrementalDetokenizer, rust_backend
from engine.request import Request
from engine.sampling_params import SamplingParams

NUM_STREAMS = 100


@pytest.fixture(params=sorted(ALL_TOKENIZERS))
def tokenizer(request):
    return ALL_TOKENIZERS[request.param]()


def detokenizer(tokenizer, prompt, rust: bool, **params) -> IncrementalDetokenizer:
    request = Request(
        "r", prompt, SamplingParams(max_tokens=None, **params), eos_token_id=tokenizer.eos_token_id
    )
    return IncrementalDetokenizer(tokenizer, request, rust=rust)


def run(detok: IncrementalDetokenizer, token_ids: list[int], chunk: int) -> tuple[list[str], str | None, str]:
    """Feed `token_ids` `chunk` at a time (a step's tokens); the streamed deltas, the stop string, the text."""
    deltas = []
    for start in range(0, len(token_ids), chunk):
        detok.update(token_ids[start : start + chunk])
        deltas.append(detok.get_next_output_text(finished=False, delta=True))
    deltas.append(detok.get_next_output_text(finished=True, delta=True))
    return deltas, detok.stop_string, detok.output_text


def random_stream(rng: random.Random, tokenizer, length: int) -> list[int]:
    """Mostly the ids of real text (whole and split characters), then random ids, specials and bytes."""
    text = rng.choice(CORPUS)
    ids = tokenizer.encode(text, add_special_tokens=False)
    start = rng.randrange(len(ids))
    stream = ids[start : start + length]
    vocab = len(tokenizer)
    for _ in range(rng.randrange(length // 2 + 1)):
        stream.insert(rng.randrange(len(stream) + 1), rng.randrange(vocab))
    return stream


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_rust_and_python_windows_agree_on_random_streams(tokenizer, skip_special_tokens):
    assert rust_backend(tokenizer) is not None
    rng = random.Random(1234 + skip_special_tokens)
    vocab = len(tokenizer)
    for case in range(NUM_STREAMS):
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(1, 12))]  # may end inside a character
        tokens = random_stream(rng, tokenizer, rng.randrange(1, 40))
        params = {"skip_special_tokens": skip_special_tokens}
        if case % 3 == 0:
            params["stop"] = [tokenizer.decode(tokens[2:4], skip_special_tokens=True) or "the"]
        if case % 4 == 1:
            params["stop_token_ids"] = [tokens[len(tokens) // 2]]
        if case % 5 == 2:
            params["ignore_eos"] = True
        chunk = rng.choice([1, 1, 2, 3])
        python = run(detokenizer(tokenizer, prompt, rust=False, **params), tokens, chunk)
        rust = run(detokenizer(tokenizer, prompt, rust=True, **params), tokens, chunk)
        assert rust == python, (case, prompt, tokens, params)


def test_the_rust_stream_is_used_and_a_tokenizer_with_its_own_decode_keeps_python(tokenizer):
    detok = detokenizer(tokenizer, [5, 6], rust=True)
    assert detok._stream is not None

    class Wrapped(type(tokenizer)):
        def _decode(self, *args, **kwargs):  # e.g. a model's own clean-up
            return super()._decode(*args, **kwargs)

    wrapped = Wrapped(tokenizer_object=tokenizer.backend_tokenizer, eos_token=tokenizer.eos_token)
    assert rust_backend(wrapped) is None
    assert detokenizer(wrapped, [5, 6], rust=True)._stream is None
