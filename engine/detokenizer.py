"""Generated token ids to text, step by step, without splitting characters or streaming half a stop string.

The window rule below is vLLM's (and `tokenizers`' `DecodeStream`'s, which implements it in Rust). A
fast tokenizer whose decoding is its Rust backend's (`PreTrainedTokenizerFast` and subclasses that do
not override `_decode`) decodes through a `DecodeStream`: the same text, without two Python-level
`tokenizer.decode` calls per token. Any other tokenizer, and a prompt whose context ends inside a
character, takes the Python window below; `tests/engine/test_detokenizer_stream.py` checks on random
token streams that both give the same text, delta by delta.
"""

from __future__ import annotations

import logging
from typing import Any

from tokenizers import Tokenizer as RustTokenizer
from tokenizers.decoders import DecodeStream
from transformers import PreTrainedTokenizerFast

from engine.request import Request
from engine.stop_checker import may_stop_at, stop_token_reason

# Prompt tokens decoded ahead of the first generated one (vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET).
# Their text is never output; it gives the first generated token its context, e.g. the leading space
# that SentencePiece decoders strip from the first token of whatever they decode.
PROMPT_CONTEXT_TOKENS = 5

# What a decoder writes for bytes that are not (yet) a whole UTF-8 character.
REPLACEMENT_CHAR = "\ufffd"
# A UTF-8 character has at most 4 bytes, so at most 3 byte tokens of one precede any token.
MAX_UTF8_BYTES = 4

logger = logging.getLogger(__name__)


class IncrementalDetokenizer:
    """Turns generated token ids into text incrementally, never splitting a multi-byte character, and finds stop strings.

    Decoding works on a small window of token ids (vLLM's `detokenize_incrementally`). Decoding single
    tokens is wrong twice over: a byte-level token can hold part of a character, and SentencePiece
    decoders drop the leading space of the first token they see. So each step decodes
    `ids[prefix_offset:read_offset]` (text already emitted) and `ids[prefix_offset:]`, and emits the
    difference once it no longer ends in REPLACEMENT_CHAR. Byte-level tokens of " the😀":

        ids:  " the"  <F0 9F>  <98>  <80>      prefix_offset 0, read_offset 1: " the" went out last step
        + <F0 9F>, + <98>: decode(ids[0:]) = " the\ufffd": hold
        + <80>:            decode(ids[0:]) = " the😀": emit what follows decode(ids[0:1]) = " the",
                           i.e. "😀"; then prefix_offset = 1 (the old read_offset), read_offset = 4.

    vLLM's convention for stop tokens: the eos or stop token id stays in the request's output ids, but
    its text is never added here. `stop_string` is set when a stop string ended the text.
    """

    def __init__(self, tokenizer: Any, request: Request, *, rust: bool = True) -> None:
        """`rust=False` keeps to the Python window even for a fast tokenizer (for comparisons)."""
        params = request.sampling_params
        self._tokenizer = tokenizer
        self._params = params
        self._eos_token_id = request.eos_token_id
        self._stop: list[str] = list(params.stop or [])
        self._backend = rust_backend(tokenizer) if rust else None
        self._ids: list[int] = self._prompt_context(request.prompt_token_ids)
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        # The Rust stream, unless the context ends inside a character (its rule would then stream the
        # context's text): the Python window handles that case as it always has.
        # The window's ids are kept either way (cheap list operations, no decoding), so the Python rule
        # can take over from the stream mid-request, where the stream's check refuses a step.
        self._stream: DecodeStream | None = None
        if self._backend is not None and not self._decode(self._ids).endswith(REPLACEMENT_CHAR):
            self._stream = DecodeStream(list(self._ids), skip_special_tokens=params.skip_special_tokens)
        self._num_output_tokens = 0
        self._last_output_text_offset = 0
        # True once a stop token or stop string ended the text: later tokens add nothing.
        self._stopped = False
        # Characters held back while streaming, so a stop string that is then cut is never sent. With
        # include_stop_str_in_output the cut lies after the stop string, inside text not yet streamed.
        self.stop_buffer_length = (
            max(len(s) for s in self._stop) - 1 if self._stop and not params.include_stop_str_in_output else 0
        )
        self.output_text = ""
        self.stop_string: str | None = None

    def update(self, new_token_ids: list[int]) -> str | None:
        """Append the text of `new_token_ids`; return the stop string if one now appears (the text is cut there)."""
        if self._stopped:
            return None
        num_chars_before = len(self.output_text)
        for token_id in new_token_ids:
            self._num_output_tokens += 1
            is_stop_token, _ = stop_token_reason(token_id, self._params, self._eos_token_id)
            if is_stop_token and may_stop_at(self._num_output_tokens, self._params):
                self._stopped = True
                break
            self.output_text += self._decode_next(token_id)
        if not self._stop or not may_stop_at(self._num_output_tokens, self._params):
            return None
        match = find_stop_string(
            self.output_text,
            len(self.output_text) - num_chars_before,
            self._stop,
            self._params.include_stop_str_in_output,
        )
        if match is None:
            return None
        self.stop_string, cut = match
        self.output_text = self.output_text[:cut]
        self._stopped = True
        return self.stop_string

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """The text to send now: all of it, or (delta) only what was not sent before.

        While the request runs the last `stop_buffer_length` characters stay back (vLLM v1 does this).
        """
        hold_back = 0 if finished else self.stop_buffer_length
        end = max(len(self.output_text) - hold_back, 0)
        if not delta:
            return self.output_text[:end]
        start = self._last_output_text_offset
        if end <= start:
            return ""
        self._last_output_text_offset = end
        return self.output_text[start:end]

    def _decode_next(self, token_id: int) -> str:
        """The text that `token_id` completes, or "" while a character is still incomplete."""
        self._ids.append(token_id)
        if self._stream is not None:
            try:
                text = self._stream.step(self._backend, token_id)
            except Exception as exc:
                # Its check that a window's text extends its prefix's failed (a byte-fallback decoder
                # turning bytes already streamed into replacement characters): the Python rule, which
                # streams what follows the prefix's length, decides this step and the rest.
                logger.debug("incremental decoding continues in Python: %s", exc)
                self._stream = None
            else:
                if text:
                    self._advance_window()
                return text or ""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if new_text.endswith(REPLACEMENT_CHAR):
            # A character is not finished yet. Truly invalid bytes wait too, until text follows them:
            # a byte-fallback decoder turns a whole run of bytes into replacement characters when any of
            # them is invalid, so their count cannot tell an unfinished character from a broken one.
            return ""
        if len(new_text) <= len(prefix_text):
            # Nothing visible yet (a skipped special token): keep the window and wait.
            return ""
        self._advance_window()
        return new_text[len(prefix_text) :]

    def _advance_window(self) -> None:
        """Text went out: the window starts where the last read ended; the ids before it are never
        decoded again."""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        del self._ids[: self._prefix_offset]
        self._read_offset -= self._prefix_offset
        self._prefix_offset = 0

    def _prompt_context(self, prompt_ids: list[int]) -> list[int]:
        """The last PROMPT_CONTEXT_TOKENS prompt ids, moved back to start on a character boundary.

        A window that starts inside a character garbles more than that character: a byte-fallback
        decoder turns the whole run of byte tokens into replacement characters.
        """
        start = max(len(prompt_ids) - PROMPT_CONTEXT_TOKENS, 0)
        for _ in range(MAX_UTF8_BYTES - 1):
            if start == 0 or not self._decode(prompt_ids[start:]).startswith(REPLACEMENT_CHAR):
                break
            start -= 1
        return list(prompt_ids[start:])

    def _decode(self, token_ids: list[int]) -> str:
        if not token_ids:
            return ""
        if self._backend is not None:  # what the tokenizer's own decode does, without its Python layers
            return self._backend.decode(token_ids, skip_special_tokens=self._params.skip_special_tokens)
        # No clean-up: it rewrites spaces around punctuation differently for a window than for the whole.
        return self._tokenizer.decode(
            token_ids,
            skip_special_tokens=self._params.skip_special_tokens,
            clean_up_tokenization_spaces=False,
        )


def rust_backend(tokenizer: Any) -> RustTokenizer | None:
    """The Rust tokenizer that decodes for `tokenizer`, when its decoding is exactly that backend's (a
    PreTrainedTokenizerFast whose class keeps its `_decode`); None otherwise (slow tokenizers, wrappers)."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if not isinstance(backend, RustTokenizer):
        return None
    if getattr(type(tokenizer), "_decode", None) is not PreTrainedTokenizerFast._decode:
        return None
    return backend


def find_stop_string(
    text: str, num_new_chars: int, stop: list[str], include_stop_str: bool
) -> tuple[str, int] | None:
    """(stop string, length to cut `text` to) for the earliest stop string that ends in the new text.

    Only the last `num_new_chars` characters are new; a match must end among them (earlier text was
    searched before). Matches at the same place go to the stop string listed first.
    """
    if num_new_chars <= 0:
        return None
    best: tuple[int, str] | None = None
    for stop_str in stop:
        start = max(len(text) - num_new_chars - len(stop_str) + 1, 0)
        index = text.find(stop_str, start)
        if index != -1 and (best is None or index < best[0]):
            best = (index, stop_str)
    if best is None:
        return None
    index, stop_str = best
    return stop_str, index + len(stop_str) if include_stop_str else index
