"""gpt-oss's MXFP4 checkpoints (the hub's): the experts' `_blocks`/`_scales` are dequantized at load.
Our dequantizer equals transformers' on random codes; a tiny checkpoint packed by hand serves the tokens
transformers gives when it loads that checkpoint dequantized (float32); bad pairs and fp8 on top are
refused."""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch
from factories import make_model
from safetensors.torch import load_file, save_file
from test_moe_models import expected_tokens, greedy
from transformers import AutoModelForCausalLM, Mxfp4Config
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from engine import LLM
from engine.model.mxfp4 import dequantize_mxfp4

MXFP4_CONFIG = {
    "quant_method": "mxfp4",
    "modules_to_not_convert": [
        "model.layers.*.self_attn",
        "model.layers.*.mlp.router",
        "model.embed_tokens",
        "lm_head",
    ],
}


def random_codes(gen, *lead, cols):
    """MXFP4 blocks [*lead, cols / 32, 16] of random codes, and scales near 2**-4 (weights ~0.15)."""
    blocks = torch.randint(0, 256, (*lead, cols // 32, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(122, 126, (*lead, cols // 32), generator=gen, dtype=torch.uint8)
    return blocks, scales


def test_dequantizer_matches_transformers():
    gen = torch.Generator().manual_seed(0)
    blocks, scales = random_codes(gen, 3, 10, cols=96)
    blocks[0, 0, 0, :2] = torch.tensor([0x7F, 0xF8], dtype=torch.uint8)  # 6, 0.5, -0, -6 ...
    scales[0, 0, 0] = 127 + 3
    ours = dequantize_mxfp4(blocks, scales, torch.float32)  # [3, 10, 96]
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [3, 96, 10]
    torch.testing.assert_close(ours, theirs.transpose(1, 2), atol=0, rtol=0)
    assert ours[0, 0, :4].tolist() == [-48.0, 48.0, -0.0, -48.0]  # low nibble first, times 2 ** 3


@pytest.fixture(scope="module")
def mxfp4(tmp_path_factory):
    """A tiny gpt-oss checkpoint whose experts are MXFP4 blocks and scales of random codes."""
    root = tmp_path_factory.mktemp("gpt-oss-mxfp4")
    dense = make_model(root / "dense", arch="gpt_oss", seed=3, intermediate_size=32)  # I a whole block
    gen = torch.Generator().manual_seed(1)
    packed = {}
    for name, tensor in load_file(str(dense / "model.safetensors")).items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            experts, rows_in, cols_out = tensor.shape  # transformers': [E, in, out]; stored rows: out
            packed[f"{name}_blocks"], packed[f"{name}_scales"] = random_codes(
                gen, experts, cols_out, cols=rows_in
            )
        else:
            packed[name] = tensor
    shutil.copytree(dense, root / "mxfp4")
    save_file(packed, str(root / "mxfp4" / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((root / "mxfp4" / "config.json").read_text())
    (root / "mxfp4" / "config.json").write_text(json.dumps({**config, "quantization_config": MXFP4_CONFIG}))
    return root / "mxfp4"


def test_mxfp4_checkpoint_serves_what_transformers_dequantizes(mxfp4):
    model = AutoModelForCausalLM.from_pretrained(
        mxfp4, quantization_config=Mxfp4Config(dequantize=True), dtype=torch.float32
    ).eval()
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (5, 13, 18)]
    expected = [expected_tokens(model, p, 6) for p in prompts]
    llm = LLM(model=str(mxfp4), dtype="float32", block_size=4, max_model_len=64, max_num_seqs=4)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(6))
    assert [o.outputs[0].token_ids for o in outputs] == expected


def test_fp8_on_top_of_mxfp4_is_refused(mxfp4):
    with pytest.raises(ValueError, match="'mxfp4'.*quantization='fp8'"):
        LLM(model=str(mxfp4), dtype="float32", max_model_len=64, quantization="fp8")


def test_blocks_without_scales_are_refused(mxfp4, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(mxfp4, broken)
    tensors = load_file(str(broken / "model.safetensors"))
    del tensors["model.layers.1.mlp.experts.down_proj_scales"]
    save_file(tensors, str(broken / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="down_proj_blocks.*not .*down_proj_scales"):
        LLM(model=str(broken), dtype="float32", max_model_len=64)


@pytest.mark.slow
def test_mxfp4_over_two_expert_parallel_ranks(mxfp4):
    """Each rank dequantizes its own experts: the tokens of one process."""
    prompts = [[7, 8, 9, 10, 11, 12, 13], [40, 41, 42]]
    args = dict(dtype="float32", block_size=4, max_model_len=64, max_num_seqs=4, async_scheduling=False)
    one = LLM(model=str(mxfp4), **args).generate([{"prompt_token_ids": p} for p in prompts], greedy(5))
    llm = LLM(model=str(mxfp4), tensor_parallel_size=2, enable_expert_parallel=True, **args)
    try:
        two = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(5))
    finally:
        llm.engine.shutdown()
    assert [o.outputs[0].token_ids for o in two] == [o.outputs[0].token_ids for o in one]
