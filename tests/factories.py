"""Tiny random checkpoints of every served family and real PEFT adapters, made at test time (no hub)."""

from __future__ import annotations

import json
from contextlib import contextmanager, nullcontext
from pathlib import Path
from unittest import mock

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    Glm4MoeConfig,
    GptOssConfig,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    OlmoeConfig,
    Phi3Config,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
)

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

_CONFIGS = {
    "llama": LlamaConfig,
    "mistral": MistralConfig,
    "qwen2": Qwen2Config,
    "qwen3": Qwen3Config,
    "gemma2": Gemma2Config,
    "gemma3": Gemma3TextConfig,
    "phi3": Phi3Config,
    "qwen3_moe": Qwen3MoeConfig,
    "mixtral": MixtralConfig,
    "qwen2_moe": Qwen2MoeConfig,
    "olmoe": OlmoeConfig,
    "gpt_oss": GptOssConfig,
    "glm4_moe": Glm4MoeConfig,
}
# What makes each newer family itself at C1's size, every feature switched on: a window shorter than the
# prompts over alternating local and global layers, soft caps small enough to bite, Gemma 3's global layers
# at another RoPE base with linear scaling, Phi-3's LongRoPE (long factors past 16 positions) over a
# partial rotary width. Special ids inside the vocabulary.
FAMILY_SIZES = {
    "qwen3": dict(head_dim=16),
    # Untied: tied, the sqrt(hidden)-scaled embedding of the last token dominates these random models'
    # logits and greedy decoding repeats it (Gemma's real checkpoints tie; test_models ties one too).
    "gemma2": dict(
        head_dim=16,
        query_pre_attn_scalar=24,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
        attn_logit_softcapping=10.0,
        final_logit_softcapping=15.0,
        tie_word_embeddings=False,
    ),
    "gemma3": dict(
        head_dim=16,
        query_pre_attn_scalar=24,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
        final_logit_softcapping=15.0,
        tie_word_embeddings=False,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 4.0},
        },
    ),
    # 8 experts, top 2 (Qwen3-MoE renormalizes here as Qwen3-30B-A3B does; Mixtral always does); Qwen3-MoE
    # with a dense middle layer (mlp_only_layers).
    "qwen3_moe": dict(
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=True,
        num_hidden_layers=3,
        mlp_only_layers=[1],
    ),
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=32),
    # Qwen2-MoE as released (top-k not renormalized) with its shared expert, a dense middle layer and
    # Qwen2's window on layer 0 (transformers makes even layers below max_window_layers sliding).
    "qwen2_moe": dict(
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        norm_topk_prob=False,
        num_hidden_layers=3,
        mlp_only_layers=[1],
        use_sliding_window=True,
        sliding_window=8,
        max_window_layers=2,
    ),
    # OLMoE as released: top-k not renormalized, q/k norms over all heads.
    "olmoe": dict(num_experts=8, num_experts_per_tok=2, intermediate_size=32, norm_topk_prob=False),
    # gpt-oss: a sliding layer (window 8, shorter than the prompts) then a full one, attention sinks and
    # biases, YaRN without truncation, a SwiGLU limit low enough that both clamps bite.
    "gpt_oss": dict(
        head_dim=16,
        num_local_experts=8,
        num_experts_per_tok=2,
        intermediate_size=24,  # 2I = 48 against H = 64: a transposed expert weight cannot load
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
        swiglu_limit=1.0,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 4.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 64,
        },
    ),
    # GLM-4.5 with every feature biting: 8 experts in 4 groups of which a token's top 2 come from the best
    # 2, a choice-only bias (drawn in make_model), renormalized then scaled weights, 2 shared experts, a
    # dense first layer, q/k/v biases, per-head q/k norms and RoPE over half of each head.
    "glm4_moe": dict(
        head_dim=16,
        n_routed_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        n_shared_experts=2,
        n_group=4,
        topk_group=2,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        first_k_dense_replace=1,
        num_hidden_layers=3,
        attention_bias=True,
        use_qk_norm=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    ),
    "phi3": dict(
        original_max_position_embeddings=16,
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.75,
            "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
            "long_factor": [1.5, 2.0, 3.0, 4.0, 6.0, 8.0],
        },
    ),
}
SPECIAL_IDS = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)

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


def family_adapters(arch: str) -> dict[str, dict]:
    """Three adapters of ranks 4, 8, 16 over different targets: attention only, MLP only, all-linear."""
    fused = arch == "phi3"  # its checkpoint (and so PEFT) names the fused projections
    return {
        "attn_r4": dict(r=4, lora_alpha=8, target_modules=["qkv_proj"] if fused else ["q_proj", "v_proj"]),
        "mlp_r8": dict(
            r=8,
            lora_alpha=16,
            use_rslora=True,
            target_modules=["gate_up_proj", "down_proj"] if fused else ["up_proj", "down_proj"],
        ),
        "all_r16": dict(r=16, lora_alpha=16, target_modules="all-linear"),
    }


def make_model(path: Path, arch: str = "llama", seed: int = 0, **overrides) -> Path:
    """Save a random model of `arch` (a key of _CONFIGS) as config.json + safetensors."""
    torch.manual_seed(seed)
    sizes = {**C1_SIZES, **(({**SPECIAL_IDS, **FAMILY_SIZES[arch]}) if arch in FAMILY_SIZES else {})}
    config = _CONFIGS[arch](**{**sizes, **overrides})
    model = AutoModelForCausalLM.from_config(config).float().eval()
    if arch in FAMILY_SIZES:  # norms away from their init (ones, or zeros for Gemma's 1 + w)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "norm" in name:
                    param.add_(0.2 * torch.randn_like(param))
                elif arch == "gpt_oss" and "bias" in name:  # initialised to zero: make them count
                    param.add_(0.2 * torch.randn_like(param))
                elif arch == "gpt_oss" and name.endswith("sinks"):  # large enough to take a real share
                    param.copy_(2.0 * torch.randn_like(param))
        if arch == "glm4_moe":  # its attention biases and router bias start at zero: make them bite
            with torch.no_grad():
                for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
                    if name.endswith((".bias", "e_score_correction_bias")):
                        tensor.add_(0.1 * torch.randn_like(tensor))
    model.save_pretrained(path, safe_serialization=True)
    return Path(path)


def make_adapter(model_dir: Path, path: Path, seed: int = 0, **lora_kwargs) -> Path:
    """Save a PEFT LoRA adapter for `model_dir` with random (non-zero) A and B."""
    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    # init_lora_weights=False leaves both A and B random, so the adapter changes the output.
    config = LoraConfig(init_lora_weights=False, **lora_kwargs)
    with as_named(lora_kwargs.get("target_modules")):
        peft_model = get_peft_model(base, config)
    peft_model.save_pretrained(path, safe_serialization=True)
    return Path(path)


def as_named(target_modules):
    """PEFT 0.21 on transformers 5 rewrites any `*.gate_proj` / `up_proj` / `down_proj` target of GLM-4.5
    (and DeepSeek) models into target_parameters on the routed experts (its v4 -> v5 MoE conversion), so
    the shared experts (`shared_experts.gate_proj`) cannot be targeted; adapters trained on transformers 4
    name them, and the engine serves those; a dense layer's MLP (`mlp.gate_proj`) likewise. This keeps
    PEFT's config as written for such targets."""
    if not any("shared_experts." in t or t.startswith("mlp.") for t in target_modules or ()):
        return nullcontext()
    return _unconverted()


def peft_from_pretrained(base, adapter: Path, **kwargs):
    """PeftModel.from_pretrained, keeping a GLM-4.5 adapter's shared-experts targets (as_named)."""
    with as_named(_target_modules(adapter)):
        return PeftModel.from_pretrained(base, adapter, **kwargs)


def _target_modules(adapter: Path) -> list[str] | None:
    targets = json.loads((Path(adapter) / "adapter_config.json").read_text()).get("target_modules")
    return targets if isinstance(targets, list) else None


@contextmanager
def _unconverted():
    with mock.patch("peft.utils.transformers_weight_conversion.convert_peft_config_for_transformers"):
        yield


def load_reference_base(model_dir: Path):
    """The transformers model the engine is held to (float32). A model that soft-caps its attention logits
    (Gemma 2) gets transformers' eager attention, named: some transformers releases (5.17, the GPU
    machines') default Gemma 2 to SDPA, which silently drops the soft cap (later ones refuse SDPA for it)."""
    softcap = getattr(AutoConfig.from_pretrained(model_dir), "attn_logit_softcapping", None)
    extra = {"attn_implementation": "eager"} if softcap is not None else {}
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **extra).eval()


def load_peft_reference(model_dir: Path, adapters: dict[str, Path]):
    """transformers + PEFT with every adapter loaded under its name (for `adapter_names=`)."""
    base = load_reference_base(model_dir)
    if not adapters:
        return base
    names = list(adapters)
    model = peft_from_pretrained(base, adapters[names[0]], adapter_name=names[0])
    for name in names[1:]:
        with as_named(_target_modules(adapters[name])):
            model.load_adapter(adapters[name], adapter_name=name)
    return model.eval()


@torch.inference_mode()
def generate_greedy(model, prompt_ids: list[int], max_new_tokens: int, top_k: int | None = None, **kwargs):
    """transformers' greedy tokens of one prompt on the model's device; with top_k, a `Greedy`: the tokens
    and each step's top_k logprobs of the raw logits (as the engine's `logprobs`, before min_tokens)."""
    input_ids = torch.tensor([prompt_ids], device=model.device)
    out = model.generate(
        input_ids=input_ids,
        attention_mask=torch.ones_like(input_ids),
        do_sample=False,
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
        pad_token_id=0,
        output_logits=top_k is not None,
        return_dict_in_generate=True,
        **kwargs,
    )
    tokens = out.sequences[0, len(prompt_ids) :].tolist()
    return tokens if top_k is None else (tokens, top_logprobs(out.logits, top_k))


def reference_greedy(
    model, prompt_ids: list[int], adapter: str | None, max_new_tokens: int, top_k: int | None = None
):
    """Greedy tokens from transformers + PEFT for one prompt; `adapter` None means the base model. With
    top_k, a `Greedy` (`generate_greedy`)."""
    kwargs = {}
    if isinstance(model, PeftModel):
        kwargs["adapter_names"] = [adapter if adapter is not None else "__base__"]
    return generate_greedy(model, prompt_ids, max_new_tokens, top_k, **kwargs)


# Adapters of a mixture of experts: attention only, the routed experts only (PEFT's target_parameters on
# the stacked expert weights), and both, at ranks 4, 8 and 16.
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
MOE_ADAPTERS = {
    "attn_r4": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "experts_r8": dict(r=8, lora_alpha=16, use_rslora=True, target_modules=[], target_parameters=EXPERTS),
    "both_r16": dict(
        r=16,
        lora_alpha=32,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
        target_parameters=EXPERTS,
    ),
}


# A shared expert's adapters (Qwen2-MoE): the shared expert alone, and everything at once. PEFT names the
# shared expert's projections by their paths (plain gate_proj would also wrap a dense layer's MLP).
SHARED_EXPERT = ["shared_expert.gate_proj", "shared_expert.up_proj", "shared_expert.down_proj"]
SHARED_EXPERT_ADAPTERS = {
    "shared_r8": dict(r=8, lora_alpha=16, target_modules=SHARED_EXPERT),
    "all_r16": dict(
        r=16,
        lora_alpha=16,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", *SHARED_EXPERT],
        target_parameters=EXPERTS,
    ),
}


# GLM-4.5's shared experts (`mlp.shared_experts`), adapted as Qwen2-MoE's shared expert is.
SHARED_EXPERTS = ["shared_experts.gate_proj", "shared_experts.up_proj", "shared_experts.down_proj"]
SHARED_EXPERTS_ADAPTERS = {
    "shared_r8": dict(r=8, lora_alpha=16, target_modules=SHARED_EXPERTS),
    "all_r16": dict(
        r=16,
        lora_alpha=16,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", *SHARED_EXPERTS],
        target_parameters=EXPERTS,
    ),
}


# A dense layer's MLP in a mixture of experts (GLM-4.5's first layers, Qwen's mlp_only_layers): PEFT
# matches names by their ends, so `mlp.gate_proj` names it alone (not the shared experts' or the experts').
DENSE_MLP = ["mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]


def dense_layer_adapters(arch: str) -> dict[str, dict]:
    """Adapters on a mixture of experts' dense layers: DoRA on their MLPs alone, and LoRA on everything
    (attention, the dense MLPs, the routed experts and any shared experts)."""
    shared = {"qwen2_moe": SHARED_EXPERT, "glm4_moe": SHARED_EXPERTS}.get(arch, [])
    attention = ["q_proj", "k_proj", "v_proj", "o_proj"]
    return {
        "dense_dora_r8": dict(r=8, lora_alpha=16, use_dora=True, target_modules=DENSE_MLP),
        "everything_r16": dict(
            r=16, lora_alpha=32, target_modules=[*attention, *DENSE_MLP, *shared], target_parameters=EXPERTS
        ),
    }


def moe_adapters(arch: str) -> dict[str, dict]:
    """The adapters a mixture of experts is tested with: MOE_ADAPTERS, plus a shared expert's."""
    shared = {"qwen2_moe": SHARED_EXPERT_ADAPTERS, "glm4_moe": SHARED_EXPERTS_ADAPTERS}
    return {**MOE_ADAPTERS, **shared.get(arch, {})}


def per_adapter_reference(model_dir: Path, adapters: dict[str, Path]):
    """{name or None: model}: one transformers (+ PEFT) model per adapter. PEFT's target_parameters
    wrappers refuse mixed-adapter batches (`adapter_names=`), so each adapter is its own model."""
    models = {None: load_peft_reference(model_dir, {})}
    for name, path in adapters.items():
        models[name] = peft_from_pretrained(load_reference_base(model_dir), path).eval()
    return models


def first_tokens_agreement(got: list[list[int]], expected: list[list[int]], num_tokens: int) -> float:
    """Each row's common prefix with its reference, over num_tokens per row: a diagnostic printed beside
    `assert_greedy_close`, never a bar (one near-tie early in a row costs the whole rest of the row)."""

    def common_prefix(a: list[int], b: list[int]) -> int:
        return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))

    return sum(common_prefix(g, e) for g, e in zip(got, expected)) / (num_tokens * len(expected))


# A row's greedy tokens and, per generated token, the top log-probabilities there (token id -> logprob).
Greedy = tuple[list[int], list[dict[int, float]]]
TOP_LOGPROBS = 5  # how deep in the other side's distribution a diverging token may sit


def top_logprobs(logits, k: int = TOP_LOGPROBS) -> list[dict[int, float]]:
    """transformers generate's per-step `logits` (each [1, vocab], output_logits=True) as top-k dicts."""
    result = []
    for step in logits:
        values, ids = step[0].float().log_softmax(-1).topk(k)
        result.append(dict(zip(ids.tolist(), values.tolist())))
    return result


def engine_greedy(output) -> Greedy:
    """An engine RequestOutput's tokens and top logprobs (the request asked for SamplingParams(logprobs=k))."""
    completion = output.outputs[0]
    return completion.token_ids, [step.top for step in completion.logprobs]


def greedy_divergences(got: list[Greedy], expected: list[Greedy], top_k: int = TOP_LOGPROBS) -> list[str]:
    """Greedy sequences compared as vLLM's tests compare them (check_logprobs_close): each row is walked to
    its first differing token, where each side's token must be among the other side's top_k; a row is not
    compared past that point (from there on the two continue different texts). Rows that never diverge
    pass. Returns one line per row that fails, empty when all pass."""
    failures = []
    for row, ((tokens_a, tops_a), (tokens_b, tops_b)) in enumerate(zip(got, expected, strict=True)):
        at = next((i for i, (a, b) in enumerate(zip(tokens_a, tokens_b)) if a != b), None)
        if at is None:
            continue
        a, b = tokens_a[at], tokens_b[at]
        top_a, top_b = (sorted(t[at], key=t[at].get, reverse=True)[:top_k] for t in (tops_a, tops_b))
        if a not in top_b or b not in top_a:
            failures.append(
                f"row {row}, token {at}: {a} vs {b}; top-{top_k} there {top_a} vs {top_b} "
                f"(logprobs {[round(tops_a[at][t], 3) for t in top_a]} vs {[round(tops_b[at][t], 3) for t in top_b]})"
            )
    return failures


def check_greedy_close(
    got: list[Greedy],
    expected: list[Greedy],
    label: str,
    num_tokens: int,
    top_k: int = TOP_LOGPROBS,
    allowed: int = 0,
) -> list[str]:
    """The bf16 GPU tests' check (`greedy_divergences`), the first-tokens agreement and how many rows
    diverge printed first as diagnostics. Returns the failures, each naming `label`, so that a test can
    report all of its comparisons before it asserts; none while at most `allowed` rows fail (mixtures of
    experts only: a bf16 routing flip earlier in a row can move the distribution past the top-k, for
    transformers against itself in float32 too, benchmarks/bf16_sensitivity.py)."""
    failures = greedy_divergences(got, expected, top_k)
    tokens_got, tokens_expected = [g[0] for g in got], [e[0] for e in expected]
    agreement = first_tokens_agreement(tokens_got, tokens_expected, num_tokens)
    diverged = sum(g != e for g, e in zip(tokens_got, tokens_expected))
    print(
        f"{label}: first-{num_tokens}-token agreement {agreement:.3f}, {diverged}/{len(got)} rows diverge, "
        f"{len(failures)} outside each other's top-{top_k} (allowed {allowed})"
    )
    for failure in failures[:allowed]:
        print(f"  allowed: {failure}")
    return [f"{label}: {failure}" for failure in failures] if len(failures) > allowed else []


def assert_greedy_close(
    got: list[Greedy], expected: list[Greedy], label: str, num_tokens: int, top_k: int = TOP_LOGPROBS
) -> None:
    failures = check_greedy_close(got, expected, label, num_tokens, top_k)
    assert not failures, "; ".join(failures)
