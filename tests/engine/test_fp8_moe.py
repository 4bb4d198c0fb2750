"""FP8 mixture-of-experts checkpoints (Qwen3-MoE and Mixtral, tiny and random, float32 on the CPU), written
as the hub's block-scaled (`weight_scale_inv` per 128x128 block) and compressed-tensors per-channel ones,
per-expert and in transformers 5's fused layout: the routed experts load dequantized, equal to a float64
dequantization of the stored values, the attention projections stay FP8, and greedy tokens with expert
LoRA adapters mixed in one batch are those of the engine and of transformers + PEFT on the dequantized
checkpoint. A missing or mis-shaped scale is refused, naming the tensor."""

from __future__ import annotations

import multiprocessing
import random
import re

import pytest
import torch
from factories import MOE_ADAPTERS, make_adapter, make_model, per_adapter_reference
from fp8_checkpoints import fuse_fp8_experts, write_block_fp8, write_compressed_tensors, write_dequantized
from safetensors.torch import load_file, save_file
from test_moe_models import expected_tokens, fuse_experts

from engine import LLM, SamplingParams
from engine.model.fp8_linear import Fp8Linear
from engine.model.loader import load_config, load_model

NUM_NEW_TOKENS = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, min_tokens=NUM_NEW_TOKENS, logprobs=3)
ARGS = dict(
    max_loras=3, max_lora_rank=16, block_size=4, max_model_len=64, dtype="float32", max_num_seqs=8,
    skip_tokenizer_init=True,
)  # fmt: skip
CPU = torch.device("cpu")
ASSIGNED = ["experts_r8", None, "both_r16", "attn_r4"]


def write_forms(model_dir, root) -> dict:
    """{form: (fp8 checkpoint, its dequantized float32 equivalent)} for the four forms."""
    block = write_block_fp8(model_dir, root / "block")
    channel = write_compressed_tensors(model_dir, root / "channel", "channel", torch.float32)
    block_ref = write_dequantized(block, root / "block_ref")
    channel_ref = write_dequantized(channel, root / "channel_ref")
    return {
        "block": (block, block_ref),
        "channel": (channel, channel_ref),
        "block_fused": (fuse_fp8_experts(block, root / "block_fused"), fuse_experts(block_ref, root / "bfr")),
        "channel_fused": (
            fuse_fp8_experts(channel, root / "channel_fused"),
            fuse_experts(channel_ref, root / "cfr"),
        ),
    }


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral", "glm4_moe"])
def case(request, tmp_path_factory):
    arch = request.param
    root = tmp_path_factory.mktemp(f"fp8-moe-{arch}")
    model_dir = make_model(root / "model", arch=arch, seed=11)
    adapters = {
        name: make_adapter(model_dir, root / name, seed=40 + i, **kwargs)
        for i, (name, kwargs) in enumerate(MOE_ADAPTERS.items())
    }
    rng = random.Random(arch)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randrange(8, 16))] for _ in ASSIGNED]
    return dict(arch=arch, root=root, forms=write_forms(model_dir, root), adapters=adapters, prompts=prompts)


def load(path):
    return load_model(path, load_config(path), torch.float32, CPU)


def generate(llm, case):
    prompts = [{"prompt_token_ids": p} for p in case["prompts"]]
    outputs = llm.generate(prompts, GREEDY, adapters=ASSIGNED)
    assert all(o.error is None for o in outputs), [o.error for o in outputs]
    return [o.outputs[0] for o in outputs]


@pytest.mark.parametrize("form", ["block", "channel", "block_fused", "channel_fused"])
def test_experts_load_dequantized_as_float64_does_attention_stays_fp8(case, form):
    fp8_dir, ref_dir = case["forms"][form]
    model = load(fp8_dir)
    reference = load(ref_dir)  # float64 products rounded to float32 (fp8_checkpoints.dequantized)
    assert model.moe_layers and len(model.moe_layers) == len(reference.moe_layers)
    for moe, ref in zip(model.moe_layers, reference.moe_layers):
        for name in ("gate_up_proj", "down_proj"):
            got, want = getattr(moe.experts, name), getattr(ref.experts, name)
            assert got.dtype == torch.float32
            assert torch.equal(got, want), name
        assert torch.equal(moe.gate.weight, ref.gate.weight)
    assert isinstance(model.model.layers[0].self_attn.qkv_proj.kernel, Fp8Linear)
    for moe in model.moe_layers:  # GLM-4.5's shared experts stay FP8, as a dense MLP
        shared = getattr(moe, "shared_experts", None)
        assert shared is None or isinstance(shared.down_proj.kernel, Fp8Linear)


def test_a_float8_router_is_dequantized_to_its_own_dtype(case, tmp_path):
    from fp8_checkpoints import dequantized, per_block

    block, _ = case["forms"]["block"]
    routers = [n for n in load_file(block / "model.safetensors") if re.search(r"(mlp|moe)\.gate\.weight$", n)]
    router = max(routers, key=lambda n: int(n.split(".")[2]))  # the last MoE layer's
    stored = {}

    def quantize_router(tensors):
        q, scale = per_block(tensors[router])
        tensors[router], tensors[router + "_scale_inv"] = q, scale
        stored["want"] = dequantized(q, scale)

    model = load(_rewrite(block, tmp_path / "router", quantize_router))
    gate = model.moe_layers[-1].gate.weight
    assert gate.dtype == torch.float32 and torch.equal(gate, stored["want"])


def test_bf16_experts_are_dequantized_to_bf16(case):
    fp8_dir, ref_dir = case["forms"]["block_fused"]
    model = load_model(fp8_dir, load_config(fp8_dir), torch.bfloat16, CPU)
    want = load(ref_dir).moe_layers[0].experts.gate_up_proj.to(torch.bfloat16)
    got = model.moe_layers[0].experts.gate_up_proj
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)


@pytest.mark.parametrize("form", ["block", "channel_fused"])
def test_greedy_matches_the_dequantized_checkpoint_with_expert_adapters(case, form):
    fp8_dir, ref_dir = case["forms"][form]
    lora_modules = {k: str(v) for k, v in case["adapters"].items()}
    got = generate(LLM(model=str(fp8_dir), lora_modules=lora_modules, **ARGS), case)
    want = generate(LLM(model=str(ref_dir), lora_modules=lora_modules, **ARGS), case)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for x, y in zip(got, want):
        for step_x, step_y in zip(x.logprobs, y.logprobs):
            assert step_x.top == pytest.approx(step_y.top, abs=1e-5)
    if case["arch"] == "qwen3_moe" and form == "block":  # and transformers + PEFT on the same values
        references = per_adapter_reference(ref_dir, case["adapters"])
        expected = [
            expected_tokens(references[a], p, NUM_NEW_TOKENS) for p, a in zip(case["prompts"], ASSIGNED)
        ]
        assert [o.token_ids for o in got] == expected


def _rewrite(src, dst, edit):
    import shutil

    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def test_a_missing_or_misshaped_expert_scale_is_refused_naming_it(case, tmp_path):
    block, _ = case["forms"]["block"]
    names = list(load_file(block / "model.safetensors"))
    scale = next(n for n in names if ".experts.3." in n and n.endswith("weight_scale_inv"))
    weight = scale.removesuffix("_scale_inv")
    missing = _rewrite(block, tmp_path / "missing", lambda t: t.pop(scale))
    with pytest.raises(ValueError, match=f"{weight!r} is float8 but has no scale"):
        load(missing)
    wrong = _rewrite(block, tmp_path / "wrong", lambda t: t.update({scale: torch.ones(3, 2)}))
    with pytest.raises(ValueError, match=f"{scale}: scale of shape \\[3, 2\\] fits no supported scheme"):
        load(wrong)
    bad = _rewrite(block, tmp_path / "bad", lambda t: t.update({scale: -t[scale]}))
    with pytest.raises(ValueError, match=f"{scale}: weight scales must be positive"):
        load(bad)
    fused, _ = case["forms"]["block_fused"]
    fused_scale = next(
        n for n in load_file(fused / "model.safetensors") if n.endswith("gate_up_proj_scale_inv")
    )
    per_expert = _rewrite(fused, tmp_path / "fused", lambda t: t.update({fused_scale: t[fused_scale][:3]}))
    with pytest.raises(
        ValueError, match=f"{fused_scale}: scale of shape .* does not hold one scale per expert"
    ):
        load(per_expert)


def test_quantization_fp8_on_a_float_moe_checkpoint_quantizes_attention_only(tmp_path):
    model_dir = make_model(tmp_path / "model", arch="qwen3_moe", seed=2)
    config = load_config(model_dir)
    model = load_model(model_dir, config, torch.float32, CPU, quantization="fp8")
    assert isinstance(model.model.layers[0].self_attn.qkv_proj.kernel, Fp8Linear)
    assert model.moe_layers[0].experts.gate_up_proj.dtype == torch.float32


@pytest.mark.slow
@pytest.mark.parametrize("form, expert_parallel", [("block", True), ("channel", False)])
def test_two_ranks_serve_an_fp8_moe_checkpoint_as_one(tmp_path, form, expert_parallel):
    """tp=2 over gloo (experts split by rows, or whole experts per rank with expert parallelism): the
    tokens of one process. Sizes whose row-parallel shards hold whole 128-column blocks."""
    sizes = dict(hidden_size=128, num_attention_heads=4, head_dim=64, intermediate_size=256)
    model_dir = make_model(tmp_path / "model", arch="qwen3_moe", seed=12, **sizes)
    fp8_dir, _ = write_forms(model_dir, tmp_path)[form]
    adapters = {
        name: str(make_adapter(model_dir, tmp_path / name, seed=50 + i, **kwargs))
        for i, (name, kwargs) in enumerate(MOE_ADAPTERS.items())
    }
    rng = random.Random(form)
    case = dict(prompts=[[rng.randrange(3, 512) for _ in range(rng.randrange(8, 16))] for _ in ASSIGNED])
    args = dict(ARGS, lora_modules=adapters, async_scheduling=False)
    want = [o.token_ids for o in generate(LLM(model=str(fp8_dir), **args), case)]
    llm = LLM(model=str(fp8_dir), tensor_parallel_size=2, enable_expert_parallel=expert_parallel, **args)
    try:
        assert llm.engine.runner.model.moe_layers[0].experts.num_local == (4 if expert_parallel else 8)
        assert [o.token_ids for o in generate(llm, case)] == want
    finally:
        llm.engine.shutdown()
    assert [p for p in multiprocessing.active_children() if p.name.startswith("tp-worker")] == []


def _poisoned_blocks(rows: int, cols: int, gen) -> torch.Tensor:  # [nb, kb] distinct positive scales
    return torch.rand(-(-rows // 128), -(-cols // 128), generator=gen, dtype=torch.float64).float() + 0.01


@pytest.mark.parametrize("layout", ["fused_blocks", "halves_blocks", "channel", "per_expert_blocks"])
def test_partial_blocks_dequantize_as_float64(layout):
    """Sizes that are not multiples of 128 (several blocks, partial ones at the edges): each value is its
    e4m3 code times its own block's (row's) scale, against a float64 reference."""
    from engine.model.fp8_experts import Fp8ExpertTensor
    from engine.model.layers.checkpoint_tensor import InMemoryTensor

    gen = torch.Generator().manual_seed(3)
    experts, inter, hidden = 3, 160, 300  # gate_up: 3 blocks of rows fused, 2 + 2 apart
    codes = (torch.randn(experts, 2 * inter, hidden, generator=gen) * 100).to(torch.float8_e4m3fn)
    if layout == "fused_blocks":
        scale = torch.stack([_poisoned_blocks(2 * inter, hidden, gen) for _ in range(experts)])
        full = (
            scale.double().repeat_interleave(128, 1)[:, : 2 * inter].repeat_interleave(128, 2)[..., :hidden]
        )
    elif layout == "halves_blocks":
        halves = [[_poisoned_blocks(inter, hidden, gen) for _ in range(2)] for _ in range(experts)]
        scale = torch.stack([torch.cat(h) for h in halves])
        full = torch.stack([
            torch.cat([h.double().repeat_interleave(128, 0)[:inter].repeat_interleave(128, 1)[:, :hidden] for h in e])
            for e in halves
        ])  # fmt: skip
    elif layout == "channel":
        scale = torch.rand(experts, 2 * inter, 1, generator=gen) + 0.01
        full = scale.double().expand(experts, 2 * inter, hidden)
    else:
        scale = _poisoned_blocks(2 * inter, hidden, gen)
        codes, full = (
            codes[0],
            scale.double().repeat_interleave(128, 0)[: 2 * inter].repeat_interleave(128, 1),
        )
        full = full[:, :hidden]
    weight = InMemoryTensor("mlp.experts.gate_up_proj", codes)
    tensor = Fp8ExpertTensor(
        weight, InMemoryTensor("mlp.experts.gate_up_proj_scale_inv", scale), torch.float32, True
    )
    want = (codes.double() * full).float()
    assert torch.equal(tensor.read(), want)
    if codes.dim() == 3:
        assert torch.equal(tensor.rows(1, 3), want[1:3])  # a rank's experts only


def test_gate_up_blocks_of_the_same_shape_either_way_are_refused_as_ambiguous():
    """I = 200: 4 blocks over the 400 fused rows, or 2 + 2 over gate and up apart, which differ."""
    from engine.model.fp8_experts import Fp8ExpertTensor
    from engine.model.layers.checkpoint_tensor import InMemoryTensor

    codes = torch.zeros(2, 400, 64).to(torch.float8_e4m3fn)
    weight = InMemoryTensor("mlp.experts.gate_up_proj", codes)
    scale = InMemoryTensor("mlp.experts.gate_up_proj_scale_inv", torch.ones(2, 4, 1))
    with pytest.raises(ValueError, match="mlp.experts.gate_up_proj_scale_inv: .* is ambiguous"):
        Fp8ExpertTensor(weight, scale, torch.float32, True)
