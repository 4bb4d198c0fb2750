"""Real Hugging Face fast tokenizers built offline, for tests that need text (no model hub).

Two families cover how real checkpoints split text:
- byte-level BPE (GPT-2, Llama 3, SmolLM2): one emoji or CJK character can span several tokens, each
  of which decodes alone to the replacement character.
- SentencePiece-style BPE with byte fallback (Llama 2, Mistral): "▁" marks spaces, the decoder strips
  the leading space of the first token, and unknown characters fall back to `<0xNN>` byte tokens.

Import the builders from other tests with `from tokenizer_fixtures import ...` (pytest puts this folder
on `sys.path`); both are cached, so building them costs once per session.
"""

from __future__ import annotations

import functools
import json

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

EOS_TOKEN = "<|endoftext|>"
BOS_TOKEN = "<s>"
UNK_TOKEN = "<unk>"

# Small vocabularies keep most multi-byte characters split across several tokens.
BYTE_LEVEL_VOCAB_SIZE = 320
BYTE_FALLBACK_VOCAB_SIZE = 200
NUM_BYTES = 256

# Training text: English, accented Latin, emoji, Chinese and Japanese, repeated so merges form.
CORPUS = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "café crème brûlée, déjà vu, naïve résumé",
    "emoji 😀 🎉 👍🏽 and flags 🇫🇷 in text",
    "你好世界，今天天气很好。こんにちは世界",
    "stop here. STOP there. The end.",
] * 4

# Text that must come out whole however the tokenizer splits it.
MULTI_BYTE_SAMPLES = [
    "café 😀 你好 the end",
    "déjà vu 🎉🎉 naïve",
    "👍🏽 こんにちは 世界!",
    "plain ascii only",
    "é",
    "😀",
]


@functools.cache
def byte_level_bpe_tokenizer() -> PreTrainedTokenizerFast:
    """A GPT-2-style byte-level BPE tokenizer; `eos_token_id` is 0, `bos_token_id` is 1."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BYTE_LEVEL_VOCAB_SIZE,
        special_tokens=[EOS_TOKEN, BOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    return _wrap(tokenizer)


@functools.cache
def byte_fallback_bpe_tokenizer() -> PreTrainedTokenizerFast:
    """A Llama-2-style BPE: "▁" spaces, a leading-space-stripping decoder, `<0xNN>` byte fallback.

    Trained on ASCII only, so every non-ASCII character is spelled with byte tokens.
    """
    tokenizer = Tokenizer(models.BPE(byte_fallback=True))
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    # Merges stay within words, as SentencePiece's do.
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="never", split=True)
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=BYTE_FALLBACK_VOCAB_SIZE,
        special_tokens=[EOS_TOKEN, BOS_TOKEN, UNK_TOKEN],
        show_progress=False,
    )
    tokenizer.train_from_iterator([text for text in CORPUS if text.isascii()], trainer)
    # The trainer never adds byte tokens; append them to the vocabulary through the JSON form.
    spec = json.loads(tokenizer.to_str())
    vocab = spec["model"]["vocab"]
    for byte in range(NUM_BYTES):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    return _wrap(Tokenizer.from_str(json.dumps(spec)), unk_token=UNK_TOKEN)


def _wrap(tokenizer: Tokenizer, **special: str) -> PreTrainedTokenizerFast:
    # No clean-up: it rewrites spaces around punctuation, so decoding pieces would disagree with the whole.
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=EOS_TOKEN,
        bos_token=BOS_TOKEN,
        clean_up_tokenization_spaces=False,
        **special,
    )


ALL_TOKENIZERS = {
    "byte_level_bpe": byte_level_bpe_tokenizer,
    "byte_fallback_bpe": byte_fallback_bpe_tokenizer,
}
