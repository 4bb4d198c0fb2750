"""Adapters in the formats beyond plain LoRA, made with PEFT at test time, and PEFT's greedy tokens for them."""

from __future__ import annotations

from pathlib import Path

import torch
from factories import generate_greedy, load_reference_base, make_adapter, make_model, peft_from_pretrained
from peft import LoraConfig, PeftModel, get_peft_model
from spec_decode_fixtures import EOS, VOCAB, echo_prompts
from transformers import AutoModelForCausalLM


def make_dora_adapter(model_dir: Path, path: Path, seed: int = 0, **lora_kwargs) -> Path:
    """A PEFT DoRA adapter with random A, B and magnitudes away from PEFT's initial ||W + s B A||
    (where they start, DoRA's scales are 1 and DoRA reduces to LoRA)."""
    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(init_lora_weights=False, use_dora=True, **lora_kwargs))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_magnitude_vector" in name:
                param.mul_(0.5 + torch.rand_like(param))
    model.save_pretrained(path, safe_serialization=True)
    return Path(path)


@torch.inference_mode()
def peft_greedy(
    model_dir: Path,
    adapter: Path | None,
    prompts: list[list[int]],
    max_new_tokens: int,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    top_k: int | None = None,
):
    """transformers + PEFT greedy tokens of each prompt under one adapter (None: the base model); with
    top_k, `Greedy` rows (tokens and top logprobs, factories.generate_greedy). One adapter per model:
    PEFT refuses mixed-adapter batches (`adapter_names`) with DoRA and with target_parameters."""
    model = load_reference_base(model_dir)
    if adapter is not None:
        model = peft_from_pretrained(model, adapter).eval()
    model = model.to(device, dtype)
    return [generate_greedy(model, prompt, max_new_tokens, top_k) for prompt in prompts]


def greedy_by_adapter(model_dir, adapters: dict, prompts, assigned, max_new_tokens, **kwargs):
    """`peft_greedy` of each prompt under its assigned adapter name (None: the base model), in order."""
    expected = [None] * len(prompts)
    for name in {*assigned}:
        rows = [i for i, a in enumerate(assigned) if a == name]
        path = adapters[name] if name is not None else None
        tokens = peft_greedy(model_dir, path, [prompts[i] for i in rows], max_new_tokens, **kwargs)
        for i, t in zip(rows, tokens):
            expected[i] = t
    return expected


def make_vocab_adapter(
    model_dir: Path, path: Path, seed: int = 0, save_base_layers: bool = True, **lora_kwargs
):
    """A PEFT adapter with its own embedding or LM head (modules_to_save) or LoRA on them, every trained
    tensor random: modules_to_save copies moved away from the base. `save_base_layers=False` saves LoRA
    on embed_tokens / lm_head without the base layers PEFT saves beside it by default."""
    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(init_lora_weights=False, **lora_kwargs))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "modules_to_save" in name:
                param.add_(0.05 * torch.randn_like(param))
            elif "lora_embedding" in name:
                param.copy_(0.3 * torch.randn_like(param))
    extra = {} if save_base_layers else {"save_embedding_layers": False}
    model.save_pretrained(path, safe_serialization=True, **extra)
    return Path(path)


def step_uses(vocab_slots, slots) -> bool:
    """Whether any of `slots` ([requests] int32, -1 for none) owns an embedding or head in `vocab_slots`
    (engine/lora/vocab.VocabSlots): the steps whose graph replays the tests count."""
    return bool(vocab_slots.owns_host[slots[slots >= 0]].any())


class VocabReplays:
    """Counts the decode-graph replays (`total`, `vocab`) and the verification-graph steps (`verify_total`,
    `verify_vocab`) of steps holding a token of an adapter with its own embedding or LM head (wraps the
    runner's graphs; a return of such steps to eager mode leaves the vocab counts at 0)."""

    def __init__(self, runner) -> None:
        self.total = self.vocab = self.verify_total = self.verify_vocab = 0
        graphs, inputs, slots = runner.graphs, runner.inputs, runner.lora_slots.vocab
        replay = graphs.replay

        def counting(num_seqs, *args, **kwargs):
            self.total += 1
            self.vocab += step_uses(slots, inputs.lora_slots[:num_seqs])
            return replay(num_seqs, *args, **kwargs)

        graphs.replay = counting
        verify = runner.verify_graphs
        if verify is not None:
            execute = verify.execute

            def counting_verify(batch, scheduled, *args, **kwargs):
                self.verify_total += 1
                self.verify_vocab += step_uses(slots, inputs.lora_slots[: len(scheduled)])
                return execute(batch, scheduled, *args, **kwargs)

            verify.execute = counting_verify


# Speculative decoding with vocab adapters: n-gram proposals, and adapters owning a head, an embedding
# and a head by LoRA, and neither, beside the base model.
SPEC_NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 3,
    "prompt_lookup_max": 3,
    "prompt_lookup_min": 1,
    "fallback_acceptance_rate": 0.0,
}
SPEC_ADAPTERS = {
    "mts_head": (make_vocab_adapter, dict(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"])),
    "lora_embed_head": (
        make_vocab_adapter,
        dict(r=4, lora_alpha=8, target_modules=["v_proj", "embed_tokens", "lm_head"]),
    ),
    "plain": (make_adapter, dict(r=8, lora_alpha=8, target_modules=["q_proj", "down_proj"])),
}


def make_vocab_spec_case(root: Path, num_tokens: int) -> dict:
    """The echo model (8 tokens: n-gram lookup finds proposals, spec_decode_fixtures), one layer, the
    SPEC_ADAPTERS and the base model, one prompt each, and transformers + PEFT's greedy tokens of each
    without an end of sequence (run the engine with ignore_eos)."""
    model = make_model(
        root / "model", seed=1, vocab_size=VOCAB, eos_token_id=EOS, bos_token_id=1, num_hidden_layers=1
    )
    adapters = {
        name: make(model, root / name, seed=20 + i, **kwargs)
        for i, (name, (make, kwargs)) in enumerate(SPEC_ADAPTERS.items())
    }
    prompts = echo_prompts(len(adapters) + 1)
    assigned = [*adapters, None]
    expected = []
    with torch.inference_mode():
        for adapter, prompt in zip(assigned, prompts):
            reference = load_reference_base(model)
            if adapter is not None:
                reference = PeftModel.from_pretrained(reference, adapters[adapter]).eval()
            reference.generation_config.eos_token_id = None
            expected.append(generate_greedy(reference, prompt["prompt_token_ids"], num_tokens))
    return dict(model=model, adapters=adapters, prompts=prompts, assigned=assigned, expected=expected)
