"""prompt_logprobs: every prompt token's log-probability, rank and top-k equal a float64 transformers (+
PEFT) reference, however the prompt is chunked, whatever the prefix cache holds, with adapters mixed in
the batch and n > 1; the engine's RequestTimes and iteration histogram count what ran."""

from __future__ import annotations

import pytest
import torch
from factories import load_peft_reference

from engine import LLM, SamplingParams, prompt_logprobs

PROMPTS = [
    [5, 17, 42, 99, 7, 250, 3, 3, 8, 61, 120, 77, 2, 300, 14, 9, 45, 46, 47, 48, 11],
    [5, 17, 42, 99, 7, 250, 3, 3, 8, 61, 120, 77, 2, 310, 15],  # shares 13 tokens with the first
    [33],  # one token: only the leading None
    [200, 201, 5, 6, 7, 8, 9],
]
TOP_K = 3


@pytest.fixture(scope="module")
def reference(text_model_dir, text_adapters):
    model = load_peft_reference(text_model_dir, text_adapters).double()

    @torch.inference_mode()
    def logprobs(prompt: list[int], adapter: str | None) -> torch.Tensor:
        """[len(prompt) - 1, vocab] float64: row i is the distribution of token i + 1."""
        ids = torch.tensor([prompt])
        out = model(input_ids=ids, adapter_names=[adapter or "__base__"])
        return torch.log_softmax(out.logits[0, :-1].double(), dim=-1)

    return logprobs


def make(text_model_dir, text_adapters, **overrides) -> LLM:
    """float32 on any device, so values compare with the float64 reference to 1e-4 (on CUDA too)."""
    args = dict(
        model=str(text_model_dir),
        lora_modules={k: str(v) for k, v in text_adapters.items()},
        max_loras=2,
        max_lora_rank=8,
        max_model_len=96,
        block_size=4,
        max_num_seqs=8,
        dtype="float32",
    )
    return LLM(**{**args, **overrides})


DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")],
    ),
]


def check_entries(entries, prompt: list[int], expected: torch.Tensor, k: int) -> None:
    assert entries[0] is None and len(entries) == len(prompt)
    for i, entry in enumerate(entries[1:]):
        row = expected[i]
        token = prompt[i + 1]
        assert entry.token_id == token
        assert entry.logprob == pytest.approx(row[token].item(), abs=1e-4)
        assert entry.rank == int((row >= row[token]).sum())
        top = row.topk(k)
        assert list(entry.top) == top.indices.tolist()
        assert list(entry.top.values()) == pytest.approx(top.values.tolist(), abs=1e-4)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("chunk", [4, 256])
def test_prompt_logprobs_equal_the_reference(text_model_dir, text_adapters, reference, chunk, device):
    """Chunked prefill (4 tokens a step: with three requests decoding, some chunks are 1 token, a
    step a CUDA graph would take without its prompt positions) and whole prompts; prefix caching on, so
    the second prompt's 13 shared tokens would be a cache hit if the engine read it; adapters and the
    base model mixed."""
    llm = make(
        text_model_dir,
        text_adapters,
        max_num_batched_tokens=chunk,
        max_num_seqs=4,
        enable_prefix_caching=True,
        device=device,
    )
    adapters = [None, "alpha", "beta", None]
    warm = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=1), adapters=[None])  # fills the cache
    assert warm[0].prompt_logprobs is None
    params = SamplingParams(max_tokens=16, temperature=0, prompt_logprobs=TOP_K, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params, adapters=adapters)
    for prompt, adapter, output in zip(PROMPTS, adapters, outputs):
        check_entries(output.prompt_logprobs, prompt, reference(prompt, adapter), TOP_K)
    # vLLM's rule: a request asking for prompt logprobs reads no prefix-cache hit
    assert outputs[0].num_cached_tokens == 0


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_prompt_logprobs_survive_preemption(text_model_dir, text_adapters, reference, async_scheduling):
    """A KV cache too small for the batch: requests are preempted (mid-prefill too) and recomputed; each
    keeps the entries it has, computes the missing ones, and none is doubled."""
    llm = make(
        text_model_dir,
        text_adapters,
        max_model_len=48,
        max_num_seqs=4,
        max_num_batched_tokens=8,
        num_kv_blocks=14,
        async_scheduling=async_scheduling,
    )
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[3], PROMPTS[0][3:]]
    adapters = ["alpha", None, "beta", None]
    params = SamplingParams(max_tokens=24, temperature=0, prompt_logprobs=2, ignore_eos=True)
    outputs = llm.generate(prompts, params, adapters=adapters)
    assert llm.engine.scheduler.num_preemptions > 0
    for prompt, adapter, output in zip(prompts, adapters, outputs):
        assert len(output.outputs[0].token_ids) == 24
        check_entries(output.prompt_logprobs, prompt, reference(prompt, adapter), 2)


def test_zero_top_and_n_children_share_one_computation(text_model_dir, text_adapters, reference):
    params = SamplingParams(n=3, max_tokens=2, temperature=1.0, seed=1, prompt_logprobs=0)
    (output,) = make(text_model_dir, text_adapters).generate([PROMPTS[3]], params, adapters=["beta"])
    assert len(output.outputs) == 3
    check_entries(output.prompt_logprobs, PROMPTS[3], reference(PROMPTS[3], "beta"), 0)
    assert all(entry.top == {} for entry in output.prompt_logprobs[1:])


def test_request_times_and_iteration_tokens(mixed_llm):
    before = mixed_llm.engine.stats().iteration_tokens
    (output,) = mixed_llm.generate([PROMPTS[3]], SamplingParams(max_tokens=4, ignore_eos=True))
    times = output.outputs[0].times
    assert times is not None and min(times.queue, times.prefill, times.decode) >= 0
    assert times.inference == pytest.approx(times.prefill + times.decode)
    after = mixed_llm.engine.stats().iteration_tokens
    assert after.bounds[:3] == (1, 8, 16)
    # one 7-token prefill step (bucket le=8), then three 1-token decode steps (bucket le=1)
    assert after.counts[0] - before.counts[0] == 3 and after.counts[1] - before.counts[1] == 1
    assert after.total - before.total == 7 + 3


@pytest.mark.parametrize("value", [-2, True, 1.5])
def test_malformed_logprob_counts_are_refused(value):
    for name in ("logprobs", "prompt_logprobs"):
        with pytest.raises(ValueError, match=name):
            SamplingParams(**{name: value})


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("prompt_logprobs", 21, "Requested prompt logprobs of 21, which is greater than max allowed: 20"),
        ("prompt_logprobs", -1, "Requested prompt logprobs of 320, which is greater than max allowed: 20"),
        ("logprobs", -1, "Requested sample logprobs of 320, which is greater than max allowed: 20"),
    ],
)
def test_counts_over_max_logprobs_fail_their_request_as_vllm(mixed_llm, field, value, message):
    (output,) = mixed_llm.generate([PROMPTS[3]], SamplingParams(max_tokens=2, **{field: value}))
    assert output.error == message and output.outputs[0].finish_reason == "error"


def test_minus_one_is_the_whole_vocabulary_without_a_cap(text_model_dir, reference):
    llm = LLM(model=str(text_model_dir), max_model_len=64, block_size=4, max_logprobs=-1, dtype="float32")
    params = SamplingParams(max_tokens=2, temperature=0, logprobs=-1, prompt_logprobs=-1)
    (output,) = llm.generate([PROMPTS[3]], params)
    vocab = 320
    check_entries(output.prompt_logprobs, PROMPTS[3], reference(PROMPTS[3], None), vocab)
    assert all(len(step.top) == vocab for step in output.outputs[0].logprobs)


def test_long_chunks_are_computed_in_bounded_slices(text_model_dir, text_adapters, reference, monkeypatch):
    """Logits of at most 3 rows at a time (a 20-row chunk: 7 slices) give the same entries."""
    monkeypatch.setattr(prompt_logprobs, "MAX_LOGIT_ELEMENTS", 3 * 320)
    params = SamplingParams(max_tokens=1, prompt_logprobs=2)
    (output,) = make(text_model_dir, text_adapters).generate([PROMPTS[0]], params, adapters=["alpha"])
    check_entries(output.prompt_logprobs, PROMPTS[0], reference(PROMPTS[0], "alpha"), 2)


def test_prompt_logprobs_beside_speculative_decoding(text_model_dir, text_adapters, reference):
    """Proposals (n-gram, from the prompt) verified in the same steps as other requests' prefill chunks:
    entries unchanged, and the tokens those of the engine without speculation."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    prompts = [PROMPTS[0], [7, 8, 9, 7, 8, 9, 7, 8, 9, 7, 8], PROMPTS[1]]
    params = SamplingParams(max_tokens=12, temperature=0, prompt_logprobs=2, ignore_eos=True)
    plain = make(text_model_dir, text_adapters, max_num_batched_tokens=8).generate(prompts, params)
    llm = make(text_model_dir, text_adapters, max_num_batched_tokens=8, speculative_config=spec)
    outputs = llm.generate(prompts, params)
    assert llm.engine.stats().spec_decode.num_drafts > 0  # proposals were verified
    for prompt, output, expected in zip(prompts, outputs, plain):
        assert output.outputs[0].token_ids == expected.outputs[0].token_ids
        check_entries(output.prompt_logprobs, prompt, reference(prompt, None), 2)
