"""Piecewise graphs for steps with prefill tokens (engine/piecewise_graphs.py) on the CPU, run uncaptured:
the buckets, the padding rows, which engines use them, and greedy tokens equal to the eager engine's and
transformers + PEFT's through chunked prefill, prefix caching, mixed adapters and base-model rows."""

from __future__ import annotations

import random
import types

import pytest
import torch
from factories import (
    C1_ADAPTERS,
    MOE_ADAPTERS,
    family_adapters,
    generate_greedy,
    load_peft_reference,
    make_adapter,
    make_model,
    per_adapter_reference,
    reference_greedy,
)

from engine import LLM, SamplingParams
from engine.cuda_graphs import UNCAPTURED_GRAPHS_ENV
from engine.input_batch import InputBatch
from engine.piecewise_graphs import PiecewiseCudaGraphs, piecewise_unsupported, token_buckets
from engine.request import NO_LORA, Request
from engine.scheduler_output import ScheduledRequest

NUM_NEW_TOKENS = 5


def test_token_buckets():
    assert token_buckets(8) == [8]
    assert token_buckets(16) == [16]
    assert token_buckets(100) == [16, 24, 32, 48, 64, 96, 100]
    assert token_buckets(2048) == [16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048]
    buckets = token_buckets(2048)
    # at most a third of a bucket is padding past the smallest one
    assert all((b - a) / b <= 1 / 3 for a, b in zip(buckets, buckets[1:]))


def test_one_place_decides_which_engines_use_pieces():
    on, off = (
        types.SimpleNamespace(piecewise_cuda_graphs=True),
        types.SimpleNamespace(piecewise_cuda_graphs=False),
    )
    model = object()
    assert piecewise_unsupported(on, model, None) is None
    assert piecewise_unsupported(off, model, None) == "piecewise_cuda_graphs is off"
    assert piecewise_unsupported(on, model, object()) == "tensor parallelism"


def _scheduled(prompt_len: int, start: int, num_new: int, blocks: list[int], slot: int) -> ScheduledRequest:
    request = Request(f"r{prompt_len}-{start}", list(range(3, 3 + prompt_len)), SamplingParams())
    request.lora_slot = slot
    return ScheduledRequest(request, num_new, start, blocks)


def test_prepare_eager_pads_to_the_bucket():
    """Rows past the step's tokens: token 0 at position 0 in the scratch block, no adapter; the real rows
    and the returned views are those of an unpadded step."""
    batch = InputBatch(4, 32, 4, 4, pad_block=9, device=torch.device("cpu"))
    eager = batch.eager
    eager.longs.device.fill_(77)  # stale rows of an earlier step
    eager.token_slots.device.fill_(3)
    step = [_scheduled(6, 5, 1, [1, 2], 2), _scheduled(7, 0, 7, [3, 4], NO_LORA)]  # a decode, a prefill
    batch.update(step)
    ids, meta, slots, rows = batch.prepare_eager(step, pad_to=16)
    assert ids.tolist() == [8, 3, 4, 5, 6, 7, 8, 9]
    assert meta.slot_mapping.tolist() == [2 * 4 + 1, 12, 13, 14, 15, 16, 17, 18]
    assert slots.tolist() == [2] + [NO_LORA] * 7 and rows.tolist() == [0, 7]
    longs = eager.longs.device
    assert longs[0, 8:16].eq(0).all() and longs[1, 8:16].eq(0).all()
    assert longs[2, 8:16].eq(9 * 4).all()  # the scratch block
    assert eager.token_slots.device[8:16].eq(NO_LORA).all()
    assert longs[0, 16:].eq(77).all(), "only the bucket's rows are sent"
    with pytest.raises(ValueError, match="cannot pad 8 tokens to 4"):
        batch.prepare_eager(step, pad_to=4)


def _llm(model_dir, **overrides) -> LLM:
    settings = dict(
        skip_tokenizer_init=True,
        max_num_seqs=8,
        max_num_batched_tokens=32,  # prompts of up to 30 tokens beside decodes: chunked prefill
        block_size=8,
        max_model_len=96,
        num_kv_blocks=64,
        dtype="float32",
    )
    return LLM(model=str(model_dir), **{**settings, **overrides})


def _install_pieces(llm: LLM) -> PiecewiseCudaGraphs:
    """Pieces on an engine of the torch attention path (no graphs otherwise; quick on the CPU)."""
    runner = llm.engine.runner
    runner.pieces = PiecewiseCudaGraphs(
        runner.model,
        runner.kv_caches,
        runner.lora_slots,
        runner.inputs.eager,
        runner.config.max_num_batched_tokens,
        runner.pad_block * runner.block_size,
        runner.device,
    )
    runner.pieces.capture()
    return runner.pieces


@pytest.fixture(scope="module")
def base_case(tmp_path_factory):
    model_dir = make_model(tmp_path_factory.mktemp("pieces") / "model", arch="llama", seed=3)
    rng = random.Random(3)
    shared = [rng.randrange(3, 512) for _ in range(17)]  # a prefix cached across requests
    prompts = [shared + [rng.randrange(3, 512) for _ in range(rng.randrange(1, 13))] for _ in range(3)]
    prompts += [[rng.randrange(3, 512) for _ in range(rng.randrange(3, 30))] for _ in range(3)]
    return dict(model_dir=model_dir, prompts=prompts)


def _generate(
    llm: LLM, prompts, adapters=None, num_tokens: int = NUM_NEW_TOKENS, speculates: bool = False
) -> list[list[int]]:
    # min_tokens as the references' min_new_tokens; but requests under min_tokens propose nothing
    params = SamplingParams(temperature=0.0, max_tokens=num_tokens, min_tokens=num_tokens)
    if speculates:
        params = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, adapters=adapters)
    assert all(o.error is None for o in outputs)
    return [o.outputs[0].token_ids for o in outputs]


def test_pieces_give_eager_tokens_and_padding_is_harmless(base_case):
    """Base model, torch attention: mixed and prefill steps replayed through the pieces (counted) give the
    eager engine's greedy tokens, with prefix-cache hits and chunked prefill; a step padded to a larger
    bucket gives the same logits and writes no KV block but the scratch one."""
    prompts = base_case["prompts"]
    eager_llm = _llm(base_case["model_dir"])
    expected = _generate(eager_llm, prompts)
    eager_llm.shutdown()
    llm = _llm(base_case["model_dir"])
    pieces = _install_pieces(llm)
    assert pieces.buckets == [16, 24, 32]
    got = _generate(llm, prompts)
    assert got == expected
    assert llm.engine.runner.num_graph_replays[2] == pieces.num_replays >= 3
    assert llm.engine.kv_cache.num_hit_tokens > 0, "the shared prefix should hit the cache"

    runner = llm.engine.runner
    request = Request("pad", prompts[0][:10], SamplingParams())
    step = [ScheduledRequest(request, 10, 0, [40, 41])]
    logits = {}
    for size in (16, 32):  # the same 10-token step in two buckets
        runner.pieces.buckets = [size]
        before = [k.clone() for k, _ in runner.kv_caches]
        runner.inputs.update(step)
        logits[size] = runner.execute(step).clone()
        for old, (new, _) in zip(before, runner.kv_caches):
            changed = (old != new).flatten(1).any(1).nonzero().flatten().tolist()
            assert set(changed) <= {40, 41, runner.pad_block}, changed
    assert torch.equal(logits[16], logits[32])
    llm.shutdown()


def test_prompt_logprobs_through_the_pieces(base_case):
    """Prompt logprobs need every row's hidden state: the last piece keeps them, as eager does."""
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=2)
    prompts = [{"prompt_token_ids": p} for p in base_case["prompts"][:3]]
    results = {}
    for piecewise in (False, True):
        llm = _llm(base_case["model_dir"])
        pieces = _install_pieces(llm) if piecewise else None
        outputs = llm.generate(prompts, params)
        results[piecewise] = [(o.prompt_logprobs, o.outputs[0].token_ids) for o in outputs]
        if pieces is not None:
            assert pieces.num_replays > 0
        llm.shutdown()
    assert results[True] == results[False]


def _case(tmp_path_factory, arch: str, adapter_kwargs: dict):
    root = tmp_path_factory.mktemp(f"pieces-{arch}")
    model_dir = make_model(root / "model", arch=arch, seed=2)
    adapters = {
        name: make_adapter(model_dir, root / name, seed=30 + i, **kwargs)
        for i, (name, kwargs) in enumerate(adapter_kwargs.items())
    }
    rng = random.Random(arch)
    names = [*adapters, None]
    shared = [rng.randrange(3, 512) for _ in range(17)]
    prompts = [shared + [rng.randrange(3, 512) for _ in range(rng.randrange(1, 9))] for _ in range(2)]
    prompts += [[rng.randrange(3, 512) for _ in range(rng.randrange(3, 30))] for _ in range(4)]
    assigned = [names[i % len(names)] for i in range(len(prompts))]
    return model_dir, adapters, prompts, assigned


@pytest.mark.slow
@pytest.mark.interpreted
@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_pieces_match_eager_and_peft_with_adapters(arch, tmp_path_factory, monkeypatch):
    """The runner's own pieces (uncaptured graphs mode, the interpreted Triton kernels as on CUDA): mixed
    adapters and base-model rows, chunked prefill and a cached prefix give the eager engine's tokens and
    PEFT's, the mixed steps counted as piecewise replays. Gemma 2: sandwich norms, soft caps, a window."""
    adapter_kwargs = C1_ADAPTERS if arch == "llama" else family_adapters(arch)
    model_dir, adapters, prompts, assigned = _case(tmp_path_factory, arch, adapter_kwargs)
    monkeypatch.setenv(UNCAPTURED_GRAPHS_ENV, "1")
    runs = {}
    for piecewise in (True, False):
        llm = _llm(
            model_dir,
            lora_modules={k: str(v) for k, v in adapters.items()},
            max_loras=4,
            max_lora_rank=16,
            attention_backend="triton",
            piecewise_cuda_graphs=piecewise,
        )
        runs[piecewise] = _generate(llm, prompts, assigned)
        replays = llm.engine.runner.num_graph_replays
        assert replays[0] > 0, "decode steps replay the decode graphs"
        assert (replays[2] > 0) == piecewise, replays
        llm.shutdown()
    assert runs[True] == runs[False]
    reference = load_peft_reference(model_dir, adapters)
    expected = [reference_greedy(reference, p, a, NUM_NEW_TOKENS) for p, a in zip(prompts, assigned)]
    assert runs[True] == expected


def test_speculative_steps_through_the_pieces(base_case):
    """n-gram proposals verified in steps the pieces hold (no verification graphs here): the sampled
    rows include the proposals' and the greedy tokens are those of decoding without speculation."""
    # 60 distinct tokens each: a sampled token often occurred before, so n-gram lookup finds proposals
    prompts = [list(range(3 + 60 * i, 63 + 60 * i)) for i in range(4)]
    plain_llm = _llm(base_case["model_dir"])
    expected = _generate(plain_llm, prompts, num_tokens=16, speculates=True)
    plain_llm.shutdown()
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    llm = _llm(base_case["model_dir"], speculative_config=spec)
    pieces = _install_pieces(llm)
    assert _generate(llm, prompts, num_tokens=16, speculates=True) == expected
    assert llm.engine.speculator.stats().num_draft_tokens > 0
    assert pieces.num_replays > 0
    llm.shutdown()


def test_a_failed_capture_leaves_mixed_steps_eager(base_case, monkeypatch, caplog):
    """A capture that fails (a GPU out of memory, a kernel that syncs) leaves the engine serving, with
    mixed steps eager and a warning saying why."""
    monkeypatch.setenv(UNCAPTURED_GRAPHS_ENV, "1")

    def fail(self, pool=None):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(PiecewiseCudaGraphs, "capture", fail)
    llm = _llm(
        base_case["model_dir"],
        attention_backend="triton",
        max_num_batched_tokens=16,
        piecewise_cuda_graphs=True,
    )
    assert llm.engine.runner.graphs is not None and llm.engine.runner.pieces is None
    assert "piecewise CUDA graphs could not be captured (RuntimeError: operation not permitted" in caplog.text
    llm.shutdown()


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_moe_models_through_the_pieces(tmp_path, arch):
    """A mixture of experts with adapters on its attention and experts: the pieces give PEFT's tokens and
    the eager engine's routing counts (padding rows are not counted as routed); gpt-oss's attention sinks
    ride through the pieces' attention calls."""
    model_dir = make_model(tmp_path / "moe", arch=arch, seed=1)
    adapters = {
        name: make_adapter(model_dir, tmp_path / name, seed=20 + i, **kwargs)
        for i, (name, kwargs) in enumerate(MOE_ADAPTERS.items())
    }
    rng = random.Random(8)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randrange(5, 20))] for _ in range(4)]
    assigned = [*adapters, None]
    runs = {}
    for piecewise in (False, True):
        llm = _llm(model_dir, lora_modules={k: str(v) for k, v in adapters.items()}, max_lora_rank=16)
        pieces = _install_pieces(llm) if piecewise else None
        tokens = _generate(llm, prompts, assigned)
        runs[piecewise] = (tokens, llm.engine.stats().moe_expert_tokens)
        if pieces is not None:
            assert pieces.num_replays > 0
        llm.shutdown()
    assert runs[True] == runs[False]
    references = per_adapter_reference(model_dir, adapters)
    expected = [generate_greedy(references[a], p, NUM_NEW_TOKENS) for p, a in zip(prompts, assigned)]
    assert runs[True][0] == expected
