"""Tokenizer and end-of-sequence ids of a checkpoint folder."""

from __future__ import annotations

import logging
from pathlib import Path

from transformers import AutoTokenizer, GenerationConfig

logger = logging.getLogger(__name__)

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def load_tokenizer(path: Path):
    """The folder's tokenizer, or None when it ships none (prompts must then be token ids)."""
    if not any((path / name).exists() for name in _TOKENIZER_FILES):
        logger.warning("%s has no tokenizer: prompts must be given as token ids", path)
        return None
    return AutoTokenizer.from_pretrained(str(path))


def eos_token_ids(path: Path, hf_config, tokenizer) -> list[int]:
    """All ids that end a sequence, the primary one first (Llama 3 checkpoints list several)."""
    ids: list[int] = []
    try:
        generation = GenerationConfig.from_pretrained(str(path)).eos_token_id
    except OSError:
        generation = None
    for source in (
        getattr(tokenizer, "eos_token_id", None),
        generation,
        getattr(hf_config, "eos_token_id", None),
    ):
        for token_id in source if isinstance(source, (list, tuple)) else [source]:
            if isinstance(token_id, int) and token_id not in ids:
                ids.append(token_id)
    return ids
