"""Tiny random Llama-family checkpoints and real PEFT adapters, made at test time (no hub)."""

from __future__ import annotations

from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

# Workload C1 (docs/ARCHITECTURE.md, Reference workloads): hidden 64, 2 layers, 4 heads, 2 KV heads, vocab 512.
C1_SIZES = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
    max_position_embeddings=256,
    # Larger than the usual 0.02 so that logits are well separated and greedy choices are not
    # decided by float32 rounding.
    initializer_range=0.2,
)

_CONFIGS = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config}

# C1's four adapters: ranks 4, 8, 8, 16 over different target modules.
C1_ADAPTERS = {
    "a_qv": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "b_attn": dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    "c_mlp": dict(r=8, lora_alpha=32, target_modules=["gate_proj", "up_proj", "down_proj"], use_rslora=True),
    "d_all": dict(
        r=16,
        lora_alpha=16,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    ),
}


def make_model(path: Path, arch: str = "llama", seed: int = 0, **overrides) -> Path:
    """Save a random model of `arch` (llama, mistral, qwen2) as config.json + safetensors."""
    torch.manual_seed(seed)
    config = _CONFIGS[arch](**{**C1_SIZES, **overrides})
    model = AutoModelForCausalLM.from_config(config).float().eval()
    model.save_pretrained(path, safe_serialization=True)
    return Path(path)


def make_adapter(model_dir: Path, path: Path, seed: int = 0, **lora_kwargs) -> Path:
    """Save a PEFT LoRA adapter for `model_dir` with random (non-zero) A and B."""
    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    # init_lora_weights=False leaves both A and B random, so the adapter changes the output.
    config = LoraConfig(init_lora_weights=False, **lora_kwargs)
    peft_model = get_peft_model(base, config)
    peft_model.save_pretrained(path, safe_serialization=True)
    return Path(path)


def load_peft_reference(model_dir: Path, adapters: dict[str, Path]):
    """transformers + PEFT with every adapter loaded under its name (for `adapter_names=`)."""
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if not adapters:
        return base
    names = list(adapters)
    model = PeftModel.from_pretrained(base, adapters[names[0]], adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(adapters[name], adapter_name=name)
    return model.eval()


@torch.inference_mode()
def reference_greedy(model, prompt_ids: list[int], adapter: str | None, max_new_tokens: int) -> list[int]:
    """Greedy tokens from transformers + PEFT for one prompt; `adapter` None means the base model."""
    input_ids = torch.tensor([prompt_ids])
    kwargs = {}
    if isinstance(model, PeftModel):
        kwargs["adapter_names"] = [adapter if adapter is not None else "__base__"]
    out = model.generate(
        input_ids=input_ids,
        attention_mask=torch.ones_like(input_ids),
        do_sample=False,
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
        pad_token_id=0,
        **kwargs,
    )
    return out[0, len(prompt_ids) :].tolist()
