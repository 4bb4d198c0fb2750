"""Shared engine fixtures: a tiny Llama with a real tokenizer, and adapters for it."""

from __future__ import annotations

import pytest
from factories import make_adapter, make_model
from tokenizer_fixtures import byte_level_bpe_tokenizer


@pytest.fixture(scope="session")
def text_model_dir(tmp_path_factory):
    """A random C1-sized Llama saved with a byte-level BPE tokenizer (eos 0, bos 1), so text works."""
    tokenizer = byte_level_bpe_tokenizer()
    path = tmp_path_factory.mktemp("text-model") / "model"
    make_model(path, arch="llama", seed=3, vocab_size=len(tokenizer), eos_token_id=0, bos_token_id=1)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def text_adapters(text_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("text-adapters")
    return {
        "alpha": make_adapter(
            text_model_dir,
            root / "alpha",
            seed=21,
            r=8,
            lora_alpha=16,
            target_modules=["q_proj", "v_proj", "down_proj"],
        ),
        "beta": make_adapter(
            text_model_dir,
            root / "beta",
            seed=22,
            r=4,
            lora_alpha=8,
            target_modules=["k_proj", "o_proj", "up_proj"],
        ),
    }


@pytest.fixture(scope="module")
def mixed_llm(text_model_dir, text_adapters):
    """An offline engine with both adapters registered, small enough for CPU tests (one per module)."""
    from engine import LLM

    return LLM(
        model=str(text_model_dir),
        lora_modules={k: str(v) for k, v in text_adapters.items()},
        max_loras=2,
        max_lora_rank=8,
        max_model_len=96,
        block_size=4,
        max_num_seqs=8,
    )
