"""Adapters in the formats beyond plain LoRA, made with PEFT at test time, and PEFT's greedy tokens for them."""

from __future__ import annotations

from pathlib import Path

import torch
from factories import generate_greedy, load_reference_base
from peft import LoraConfig, PeftModel, get_peft_model
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
        model = PeftModel.from_pretrained(model, adapter).eval()
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


class VocabReplays:
    """Counts the decode-graph replays of steps holding a token of an adapter with its own embedding or
    LM head (wraps the runner's graphs; a return of such steps to eager mode leaves `vocab` at 0)."""

    def __init__(self, runner) -> None:
        self.total = self.vocab = 0
        graphs, inputs, slots = runner.graphs, runner.inputs, runner.lora_slots.vocab
        replay = graphs.replay

        def counting(num_seqs, *args, **kwargs):
            self.total += 1
            self.vocab += slots.step_uses(inputs.lora_slots[:num_seqs])
            return replay(num_seqs, *args, **kwargs)

        graphs.replay = counting
