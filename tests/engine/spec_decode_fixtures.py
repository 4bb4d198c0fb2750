"""A tiny model whose greedy output repeats itself (8 tokens of vocabulary), two adapters, and prompts.

With 8 tokens a random model falls into short cycles, so n-gram lookup finds proposals that are often,
but not always, accepted: the tests see both accepted and rejected drafts.
"""

from __future__ import annotations

from factories import make_adapter, make_model

VOCAB = 8
EOS = 0


def make_echo_case(root):
    model = make_model(root / "model", seed=1, vocab_size=VOCAB, eos_token_id=EOS, bos_token_id=1)
    # A second, different model with the same vocabulary: a draft whose proposals are often wrong.
    other = make_model(
        root / "other", seed=2, vocab_size=VOCAB, eos_token_id=EOS, bos_token_id=1, num_hidden_layers=1
    )
    adapters = {
        "qv": make_adapter(
            model, root / "qv", seed=11, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]
        ),
        "mlp": make_adapter(
            model, root / "mlp", seed=12, r=8, lora_alpha=8, target_modules=["gate_proj", "down_proj"]
        ),
    }
    return dict(model=model, other=other, adapters=adapters)


def echo_prompts(count: int, length: int = 10, shared_prefix: list[int] | None = None) -> list[dict]:
    prefix = list(shared_prefix or [])
    return [
        {"prompt_token_ids": prefix + [1 + (i * 5 + j * 3) % (VOCAB - 1) for j in range(length + i % 5)]}
        for i in range(count)
    ]
