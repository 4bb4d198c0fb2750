"""Adapters with their own embedding or LM head under tensor parallelism, on the CPU (gloo, 2 ranks): each
rank holds its vocabulary rows of every slot's matrices (engine/parallel/lora_shards.py), and a batch
mixing modules_to_save (embed_tokens, lm_head), LoRA on embed_tokens / lm_head (merged whole, and as
factors merged on each rank), a plain adapter and the base model gives one rank's and transformers +
PEFT's greedy tokens, through slot refills and a vocabulary the ranks do not divide; prompt logprobs from
an own head equal one rank's; decode and verification graph steps (uncaptured) hold the path too."""

from __future__ import annotations

import random
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch
from factories import make_adapter, make_model
from formats_fixtures import SPEC_NGRAM, greedy_by_adapter, make_vocab_adapter, make_vocab_spec_case

from engine import LLM, SamplingParams
from engine.cuda_graphs import UNCAPTURED_GRAPHS_ENV
from engine.lora.vocab import EMBED, FACTORS, HEAD, OWN, TABLE_COLUMNS, VocabSlots, part_shapes
from engine.parallel.lora_shards import vocab_shard

NUM_TOKENS = 6
VOCAB = 511  # odd: the second rank's shard has a padding row
ADAPTERS = {
    "mts_embed": (make_vocab_adapter, dict(r=4, target_modules=["v_proj"], modules_to_save=["embed_tokens"])),
    "mts_head": (make_vocab_adapter, dict(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"])),
    "lora_embed_head": (
        make_vocab_adapter,
        dict(r=8, lora_alpha=16, target_modules=["q_proj", "embed_tokens", "lm_head"]),
    ),
    "lora_nobase": (
        make_vocab_adapter,
        dict(r=4, target_modules=["embed_tokens", "lm_head"], save_base_layers=False),
    ),
    "plain": (make_adapter, dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "o_proj"])),
}
ARGS = dict(
    max_loras=3,  # fewer slots than adapters: slots refilled, vocab slots taken by plain adapters too
    max_vocab_loras=2,
    max_lora_rank=8,
    block_size=8,
    max_model_len=64,
    dtype="float32",
    max_num_seqs=8,
    max_num_batched_tokens=256,
)


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp-vocab")
    model_dir = make_model(root / "model", arch="llama", seed=5, vocab_size=VOCAB)
    adapters = {
        name: make(model_dir, root / name, seed=60 + i, **kwargs)
        for i, (name, (make, kwargs)) in enumerate(ADAPTERS.items())
    }
    rng = random.Random(9)
    names = [*adapters, None]
    prompts = [[rng.randrange(3, VOCAB) for _ in range(rng.randrange(5, 12))] for _ in range(len(names))]
    expected = greedy_by_adapter(model_dir, adapters, prompts, names, NUM_TOKENS)
    return dict(model_dir=model_dir, adapters=adapters, prompts=prompts, assigned=names, expected=expected)


@contextmanager
def engine(model_dir, **args):
    """An LLM whose workers are stopped however the test ends (and checked gone)."""
    llm = LLM(model=str(model_dir), **args)
    workers = [] if llm.engine.runner.parallel is None else llm.engine.runner.parallel.workers.processes
    try:
        yield llm
    finally:
        llm.engine.shutdown()
        assert not [p for p in workers if p.is_alive()], "a worker outlived the engine"


def greedy(llm, prompts, assigned, max_tokens=NUM_TOKENS, **kwargs):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, **kwargs)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, adapters=assigned)
    assert all(o.error is None for o in outputs), [o.error for o in outputs]
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.slow
def test_vocab_adapters_over_two_ranks_match_one_rank_and_peft(case):
    adapters = {k: str(v) for k, v in case["adapters"].items()}
    prompt, head = case["prompts"][1], "mts_head"
    logprobs_params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=2)
    with engine(case["model_dir"], lora_modules=adapters, **ARGS) as llm:
        one_rank = llm.generate([{"prompt_token_ids": prompt}], logprobs_params, adapters=[head])[0]
    with engine(case["model_dir"], lora_modules=adapters, tensor_parallel_size=2, **ARGS) as llm:
        got = greedy(llm, case["prompts"], case["assigned"], min_tokens=NUM_TOKENS)
        assert llm.engine.lora.allocator.num_evictions > 0, "slots were meant to be refilled"
        two_ranks = llm.generate([{"prompt_token_ids": prompt}], logprobs_params, adapters=[head])[0]
        slots = llm.engine.runner.lora_slots.vocab
        assert slots.matrices[0].shape[1] == 256  # this rank's vocabulary rows only
    for tokens, expected, adapter in zip(got, case["expected"], case["assigned"]):
        assert tokens == expected, f"adapter {adapter}"
    # the workers' own-head columns join the prompt logprobs' gathers
    for x, y in zip(one_rank.prompt_logprobs[1:], two_ranks.prompt_logprobs[1:]):
        assert (x.token_id, x.rank, list(x.top)) == (y.token_id, y.rank, list(y.top))
        assert y.logprob == pytest.approx(x.logprob, abs=1e-4)


@pytest.mark.slow
@pytest.mark.interpreted
def test_vocab_graph_steps_over_two_ranks_match_peft(tmp_path, monkeypatch):
    """Decode and verification graph steps, replayed uncaptured on the interpreted kernels on both
    ranks, with the own embeddings and heads inside: PEFT's tokens."""
    monkeypatch.setenv(UNCAPTURED_GRAPHS_ENV, "1")  # the workers inherit it
    spec_case = make_vocab_spec_case(tmp_path, 10)
    args = dict(
        lora_modules={k: str(v) for k, v in spec_case["adapters"].items()},
        skip_tokenizer_init=True,
        tensor_parallel_size=2,
        max_loras=3,
        max_vocab_loras=2,
        max_lora_rank=8,
        attention_backend="triton",
        dtype="float32",
        max_model_len=32,
        block_size=4,
        max_num_seqs=4,
        max_num_batched_tokens=64,
    )
    prompts = [p["prompt_token_ids"] for p in spec_case["prompts"]]
    with engine(spec_case["model"], speculative_config=SPEC_NGRAM, **args) as llm:
        got = greedy(llm, prompts, spec_case["assigned"], 10, ignore_eos=True)
        stats = llm.engine.stats()
    assert got == spec_case["expected"]
    # steps where no request proposes replay the decode graphs, the others the verification graphs
    assert stats.num_decode_graph_replays > 0 and stats.num_verify_graph_replays > 0


def _fake_shard(vocab: int, hidden: int, rank: int, world: int, weights: tuple[torch.Tensor, torch.Tensor]):
    """What VocabSlots reads of a model: rank `rank`'s embedding and head rows of `weights` (padded)."""
    per_rank = -(-vocab // world)
    start = rank * per_rank
    cut = [torch.zeros(per_rank, hidden) for _ in weights]
    for c, w in zip(cut, weights):
        c[: max(0, min(vocab, start + per_rank) - start)] = w[start : start + per_rank]
    embedding = SimpleNamespace(
        weight=cut[0], vocab_start=start, vocab_per_rank=per_rank, vocab_size=vocab, hidden_size=hidden
    )
    return SimpleNamespace(
        model=SimpleNamespace(embed_tokens=embedding), lm_head=SimpleNamespace(weight=cut[1])
    )


def test_vocab_rows_cut_over_ranks_equal_one_ranks():
    """An own embedding (whole) and a head as LoRA factors (merged on each rank with its base rows): the
    ranks' rows, in the shapes a worker receives them, side by side equal one rank's matrices."""
    vocab, hidden, rank, world = 37, 8, 3, 2
    torch.manual_seed(0)
    base = (torch.randn(vocab, hidden), torch.randn(vocab, hidden))
    room = torch.zeros(2, vocab, hidden)
    table = torch.zeros(2, TABLE_COLUMNS, dtype=torch.int32)
    room[EMBED] = torch.randn(vocab, hidden)
    table[EMBED, 0] = OWN
    left, right = torch.randn(vocab, rank), torch.randn(rank, hidden)
    flat = room[HEAD].view(-1)
    flat[: vocab * rank] = left.flatten()
    flat[vocab * rank : vocab * rank + rank * hidden] = right.flatten()
    table[HEAD, 0], table[HEAD, 1] = FACTORS, rank
    table[HEAD, 2:3].view(torch.float32)[0] = 0.5
    whole = VocabSlots(_fake_shard(vocab, hidden, 0, 1, base), 1, 2, torch.float32, torch.device("cpu"))
    whole.load_image(0, room, table)
    assert torch.allclose(whole.matrices[HEAD][0], base[1] + 0.5 * left @ right, atol=1e-5)
    plan = SimpleNamespace(vocab_range=lambda r: (r * 19, min(r * 19 + 19, vocab)))
    image = SimpleNamespace(vocab=room, vocab_table=table)
    for r in range(world):
        shard = VocabSlots(
            _fake_shard(vocab, hidden, r, world, base), 1, 2, torch.float32, torch.device("cpu")
        )
        parts = vocab_shard(image, plan, r)
        start, end = plan.vocab_range(r)
        assert [[t.shape for t in part] for part in parts] == part_shapes(table, end - start, hidden)
        shard.load(0, parts, table)
        for index in (EMBED, HEAD):
            got = shard.matrices[index][0]
            # (the merge's products per row, in other row blocks: equal up to the BLAS's blocking)
            torch.testing.assert_close(got[: end - start], whole.matrices[index][0][start:end])
            assert not got[end - start :].any()  # the last shard's padding row
        assert shard.owner[:, 0].tolist() == [0, 0]
