"""Rank buckets on the GPU with decode graphs: a pool for rank 64 captures one graph per bucket variant,
each decode step replays the one sized to the ranks of its adapters, and the tokens stay those of the
eager engine and of transformers + PEFT (float32), for steps of rank-8 adapters alone, rank-64 ones alone
and both together; and no bucket variant compiles after the warm-up (GPU only)."""

from __future__ import annotations

import random

import pytest
import torch
from factories import load_peft_reference, make_adapter, make_model, reference_greedy

from engine import LLM, SamplingParams

NUM_NEW_TOKENS = 10
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PROMPTS = [[5, 9, 23, 7], [40, 2, 11, 3, 8], [17, 4, 31], [6, 6, 12, 90, 3, 2]]
# Which adapter each prompt uses, per case: rank 8 only (one bucket), rank 64 only, and both (a launch
# pair per bucket), with a base-model row in each.
CASES = {
    "small": ["small", "small", None, "small"],
    "large": ["large", None, "large", "large"],
    "both": ["small", "large", None, "large"],
}


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    root = tmp_path_factory.mktemp("rank-buckets-gpu")
    model_dir = make_model(root / "model", arch="llama", seed=21)
    adapters = {
        "small": make_adapter(
            model_dir, root / "small", seed=22, r=8, target_modules=["q_proj", "down_proj"]
        ),
        "large": make_adapter(
            model_dir, root / "large", seed=23, r=64, target_modules=["q_proj", "v_proj", "up_proj"]
        ),
    }
    return model_dir, adapters


def make_llm(mixed, enforce_eager: bool) -> LLM:
    model_dir, adapters = mixed
    return LLM(
        model=str(model_dir),
        skip_tokenizer_init=True,
        lora_modules={k: str(v) for k, v in adapters.items()},
        max_loras=2,
        max_lora_rank=64,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        block_size=16,
        max_model_len=64,
        dtype="float32",
        device="cuda",
        enforce_eager=enforce_eager,
        num_kv_blocks=32,
    )


def test_each_decode_step_replays_the_graph_of_its_rank_buckets(mixed):
    llm = make_llm(mixed, enforce_eager=False)
    graphs = llm.engine.runner.graphs
    assert graphs.variants == [(16,), (64,), (16, 64)]
    assert {lora for _, lora in graphs.graphs} == {(), (16,), (64,), (16, 64)}
    replayed: list[tuple[int, ...] | None] = []
    replay = graphs.replay

    def recording(num_seqs, size, use_lora, rank_buckets=None):
        replayed.append(rank_buckets if use_lora else ())
        return replay(num_seqs, size, use_lora, rank_buckets)

    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, min_tokens=NUM_NEW_TOKENS)
    # Both adapters resident first: a request whose adapter is still loading waits while the base-model
    # row decodes alone, which would replay the no-LoRA graph.
    llm.generate([{"prompt_token_ids": PROMPTS[0]}] * 2, params, adapters=["small", "large"])
    graphs.replay = recording
    reference = load_peft_reference(*mixed)
    eager = make_llm(mixed, enforce_eager=True)
    expected_buckets = {"small": {(16,)}, "large": {(64,)}, "both": {(16, 64)}}
    for case, assigned in CASES.items():
        replayed.clear()
        requests = [{"prompt_token_ids": p} for p in PROMPTS]
        outputs = llm.generate(requests, params, adapters=assigned)
        assert all(o.error is None for o in outputs)
        tokens = [o.outputs[0].token_ids for o in outputs]
        assert len(replayed) >= NUM_NEW_TOKENS - 1, "decode steps should replay graphs"
        # Every request runs all its decode steps together here (same output length, one prefill step).
        assert set(replayed) == expected_buckets[case], (case, set(replayed))
        eager_tokens = [o.outputs[0].token_ids for o in eager.generate(requests, params, adapters=assigned)]
        assert tokens == eager_tokens, case
        expected = [reference_greedy(reference, p, a, NUM_NEW_TOKENS) for p, a in zip(PROMPTS, assigned)]
        assert tokens == expected, case


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
def test_no_rank_bucket_variant_compiles_after_ready(mixed, enforce_eager):
    """bf16, batches of every size mixing the rank-8 and rank-64 adapters and the base model: the warm-up
    compiled each bucket variant's kernels (windowed and not), so nothing compiles while serving."""
    model_dir, adapters = mixed
    llm = LLM(
        model=str(model_dir),
        skip_tokenizer_init=True,
        lora_modules={k: str(v) for k, v in adapters.items()},
        max_loras=2,
        max_lora_rank=64,
        max_num_seqs=16,
        max_num_batched_tokens=256,
        block_size=16,
        max_model_len=256,
        dtype="bfloat16",
        device="cuda",
        enforce_eager=enforce_eager,
    )
    engine = llm.engine
    assert engine.stats().num_kernel_compiles_after_ready == 0
    rng = random.Random(8)
    choices = [["small"], ["large"], ["small", "large", None]]
    for batch_size in (1, 2, 3, 5, 8, 13, 16, 24):
        for names in choices:
            prompts = [
                {
                    "prompt_token_ids": [
                        rng.randrange(3, 512) for _ in range(rng.choice([1, 3, 16, 17, 63, 200]))
                    ]
                }
                for _ in range(batch_size)
            ]
            chosen = [rng.choice(names) for _ in prompts]
            params = SamplingParams(temperature=0.0, max_tokens=rng.choice([2, 5, 9]), ignore_eos=True)
            outputs = llm.generate(prompts, params, adapters=chosen)
            assert all(o.error is None for o in outputs)
    compiled = engine.stats().num_kernel_compiles_after_ready
    assert compiled == 0, f"{compiled} kernel variants compiled after ready: {list(engine._compiles.recent)}"
