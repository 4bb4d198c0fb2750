"""An FP8 mixture-of-experts checkpoint (tiny random Qwen3-MoE, block-scaled) on the GPU (skipped
elsewhere): the experts dequantized on the device, CUDA graphs replayed, and with the `dequant` GEMM the
greedy tokens of the engine serving the dequantized float32 checkpoint, expert adapters mixed in; with the
FP8 tensor cores (`auto`: scaled_mm on attention) in bf16 it serves, and its agreement with the
dequantized bf16 checkpoint is printed (activations quantized per token differ from bf16 ones).

    TRITON_INTERPRET=0 python -m pytest tests/engine/test_fp8_moe_gpu.py -m gpu -q -s
"""

from __future__ import annotations

import gc
import random

import pytest
import torch
from factories import MOE_ADAPTERS, first_tokens_agreement, make_adapter, make_model
from fp8_checkpoints import write_block_fp8, write_dequantized

from engine import LLM, SamplingParams
from engine.model.fp8_linear import Fp8Linear

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
        reason="needs a CUDA GPU with FP8 tensor cores (8.9+)",
    ),
]
NUM_TOKENS = 16
ARGS = dict(max_loras=3, max_lora_rank=16, max_model_len=128, max_num_seqs=8, skip_tokenizer_init=True)


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8-moe-gpu")
    model_dir = make_model(root / "model", arch="qwen3_moe", seed=21)
    fp8 = write_block_fp8(model_dir, root / "fp8")
    adapters = {
        name: str(make_adapter(model_dir, root / name, seed=60 + i, **kwargs))
        for i, (name, kwargs) in enumerate(MOE_ADAPTERS.items())
    }
    rng = random.Random(21)
    assigned = ["experts_r8", None, "both_r16", "attn_r4"] * 2
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randrange(17, 60))] for _ in assigned]
    return dict(
        fp8=fp8,
        ref=write_dequantized(fp8, root / "ref"),
        adapters=adapters,
        prompts=prompts,
        assigned=assigned,
    )


def run(case, model, **kwargs):
    llm = LLM(model=str(model), lora_modules=case["adapters"], **{**ARGS, **kwargs})
    try:
        params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, min_tokens=NUM_TOKENS)
        outputs = llm.generate(
            [{"prompt_token_ids": p} for p in case["prompts"]], params, adapters=case["assigned"]
        )
        assert all(o.error is None for o in outputs), [o.error for o in outputs]
        model = llm.engine.runner.model
        experts = model.moe_layers[0].experts.gate_up_proj
        gemm = model.model.layers[0].self_attn.qkv_proj.kernel
        replays = 0 if llm.engine.runner.graphs is None else llm.engine.runner.graphs.num_replays
        return [o.outputs[0].token_ids for o in outputs], experts, gemm, replays
    finally:
        llm.engine.shutdown()
        del llm
        gc.collect()
        torch.cuda.empty_cache()


def test_dequant_gemm_gives_the_dequantized_checkpoints_tokens(case):
    got, experts, gemm, replays = run(case, case["fp8"], dtype="float32", fp8_gemm="dequant")
    want, *_ = run(case, case["ref"], dtype="float32")
    assert experts.is_cuda and experts.dtype == torch.float32
    assert isinstance(gemm, Fp8Linear) and replays > 0
    assert got == want


def test_fp8_tensor_cores_serve_bf16(case):
    got, experts, gemm, replays = run(case, case["fp8"], dtype="bfloat16")
    want, *_ = run(case, case["ref"], dtype="bfloat16")
    assert experts.dtype == torch.bfloat16 and isinstance(gemm, Fp8Linear) and replays > 0
    print(f"FP8 MoE ({gemm.gemm}) vs dequantized bf16: {first_tokens_agreement(got, want, NUM_TOKENS):.1%}")
