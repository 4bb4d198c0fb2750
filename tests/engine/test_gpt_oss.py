"""gpt-oss against transformers + PEFT on a tiny random float32 checkpoint (8 experts, top 2, a sliding
layer then a full one, attention sinks, biases, YaRN, the clamped SwiGLU): greedy tokens identical for the
base model and adapters on attention, on the routed experts (PEFT's target_parameters: gate_up_proj's
lora_B rows interleave gate and up as its weight does) and on both, mixed in one batch, through chunked
prefill with prefix-cache hits, on the torch and the Triton (interpreted) paths."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from factories import make_adapter
from test_moe_models import CHUNKED, build_case, generate, greedy, make_llm

from adapter_format.checkpoint import load_peft_adapter, peft_adapter_from_memory
from adapter_format.errors import AdapterError
from engine import SamplingParams, model_shape
from engine.model.architectures.gpt_oss import GptOssModel
from engine.model.loader import load_config

NUM_NEW_TOKENS = 8


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    return build_case("gpt_oss", tmp_path_factory.mktemp("gpt-oss"))


def test_what_the_tiny_model_exercises(case):
    """The features under test bite: prompts longer than the window, both clamps of the SwiGLU."""
    config = load_config(case["model_dir"])
    assert config.layer_types == ["sliding_attention", "full_attention"]
    assert max(len(p) for p in case["prompts"]) > config.sliding_window
    experts = case["references"][None].model.layers[0].mlp.experts
    x = torch.randn(64, config.hidden_size)
    gate_up = x @ experts.gate_up_proj[0] + experts.gate_up_proj_bias[0]
    assert (gate_up[:, ::2] > config.swiglu_limit).any() and (
        gate_up[:, 1::2].abs() > config.swiglu_limit
    ).any()


def test_expert_adapters_reorder_interleaved_gate_up(case):
    """PEFT's gate_up lora_B rows alternate gate and up: read as every gate row, then every up row."""
    shape = model_shape(load_config(case["model_dir"]))
    assert shape.gate_up_interleaved and shape.targets[-2:] == ("experts.gate_up_proj", "experts.down_proj")
    adapter = load_peft_adapter(case["adapters"]["experts_r8"], shape, 16)
    pair = adapter.modules[(0, "experts.gate_up_proj")]
    wrapper = case["references"]["experts_r8"].base_model.model.model.layers[0].mlp.experts
    # PEFT nests one wrapper per target parameter: find gate_up_proj's, [E, H, 2I].
    while wrapper.get_param().shape[-1] != 2 * shape.moe_intermediate_size:
        wrapper = wrapper.base_layer
    delta = wrapper.get_delta_weight("default")  # [E, H, 2I], interleaved columns
    ours = torch.einsum("eor,eri->eoi", pair.lora_b.float(), pair.lora_a.float()) * pair.scale  # [E, 2I, H]
    inter = shape.moe_intermediate_size
    torch.testing.assert_close(ours[:, :inter], delta[:, :, 0::2].transpose(1, 2), atol=1e-5, rtol=0)
    torch.testing.assert_close(ours[:, inter:], delta[:, :, 1::2].transpose(1, 2), atol=1e-5, rtol=0)


def test_adapters_streamed_from_a_store_read_as_from_a_folder(case):
    """Background loads read an adapter from memory (peft_adapter_from_memory): its expert pairs split and
    de-interleaved as load_peft_adapter's are."""
    shape = model_shape(load_config(case["model_dir"]))
    folder = case["adapters"]["both_r16"]
    weights = bytearray((folder / "adapter_model.safetensors").read_bytes())
    streamed = peft_adapter_from_memory((folder / "adapter_config.json").read_bytes(), weights, shape, 16)
    loaded = load_peft_adapter(folder, shape, 16)
    assert streamed.modules.keys() == loaded.modules.keys()
    assert any(module.startswith("experts.") for _, module in loaded.modules)
    for key, pair in loaded.modules.items():
        assert torch.equal(streamed.modules[key].lora_a, pair.lora_a), key
        assert torch.equal(streamed.modules[key].lora_b, pair.lora_b), key


def test_greedy_matches_transformers_peft(case):
    llm = make_llm(case, **CHUNKED)
    assert generate(llm, case) == case["expected"]
    assert llm.engine.stats().num_prefix_cache_hits > 0


@pytest.mark.slow
@pytest.mark.interpreted
def test_triton_path_matches_transformers(case):
    """Triton paged attention with sinks and the fused-MoE kernels with biases and the clamped SwiGLU
    (interpreted), with the expert LoRA kernels: transformers + PEFT's tokens."""
    llm = make_llm(case, attention_backend="triton", **CHUNKED)
    count = 4  # one request per adapter and one without
    assert generate(llm, case, greedy(4), count) == [e[:4] for e in case["expected"][:count]]


def test_lora_on_the_router_is_refused(case, tmp_path):
    """PEFT adapts the router only as a parameter (it is no Linear module); served nowhere, refused by name."""
    shape = model_shape(load_config(case["model_dir"]))
    path = make_adapter(
        case["model_dir"],
        tmp_path / "router",
        seed=5,
        r=4,
        target_modules=[],
        target_parameters=["mlp.router.weight"],
    )
    with pytest.raises(AdapterError, match="router"):
        load_peft_adapter(path, shape, 16)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(layer_types=["sliding_attention", "chunked_attention"]), "only sliding_attention and full"),
        (dict(sliding_window=None), "no sliding_window"),
    ],
)
def test_config_settings_not_served_are_refused(case, change, message):
    config = load_config(case["model_dir"])
    for key, value in change.items():
        setattr(config, key, value)
    with pytest.raises(ValueError, match=message):
        GptOssModel.check_config(config)


def test_configs_without_swiglu_fields_get_the_reference_values():
    """Configs that predate the swiglu fields (the reference hard-codes alpha): 1.702 and 7.0."""
    config = SimpleNamespace(num_local_experts=8, num_experts_per_tok=2, intermediate_size=24)
    spec = GptOssModel.moe_spec(None, config)  # reads the config alone
    assert (spec.swiglu_alpha, spec.swiglu_limit) == (1.702, 7.0)
    config.swiglu_limit = 3.5
    assert GptOssModel.moe_spec(None, config).swiglu_limit == 3.5


def test_speculative_decoding_keeps_the_greedy_tokens(case):
    """n-gram proposals verified with each request's adapter (several tokens per sequence through sinks,
    windows and the experts)."""
    prompts = [p[:6] + [7, 8, 9, 10] * 4 for p in case["prompts"][:4]]  # the last tokens occurred before
    repetitive = {**case, "prompts": prompts}
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
    plain = generate(make_llm(case, max_num_seqs=4), repetitive, params, count=4)
    llm = make_llm(case, max_num_seqs=4, speculative_config=spec)
    assert generate(llm, repetitive, params, count=4) == plain
    assert llm.engine.speculator.stats().num_draft_tokens > 0
