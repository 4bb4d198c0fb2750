"""Sampler: greedy, temperature, top-k, top-p, per-request seeds, logprobs and min_tokens."""

from __future__ import annotations

import math

import pytest
import torch

from engine.request import Request
from engine.sampler import Sampler, apply_top_k_top_p
from engine.sampling_params import SamplingParams

VOCAB = 64
EOS = 3
NUM_DRAWS = 20_000  # rows sampled in one call for distribution checks
# Logits of a small vocabulary whose distribution the empirical tests compare against.
SMALL_LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -1.0])
# Generators and kernels differ per device: the device-sensitive tests run on each one present.
DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")],
    ),
]


def make_request(i: int, eos_token_id: int | None = EOS, num_output_tokens: int = 0, **params) -> Request:
    request = Request(f"r{i}", [1, 2, 3], SamplingParams(**params), eos_token_id=eos_token_id)
    for _ in range(num_output_tokens):
        request.append_output_token(7)
    return request


def random_logits(num_rows: int, seed: int = 0, vocab: int = VOCAB) -> torch.Tensor:
    return torch.randn(num_rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def expected_distribution(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Reference: softmax(logits / T), truncated to the top-k, then to the smallest nucleus of mass >= p."""
    probs = (logits.double() / temperature).softmax(-1)
    order = probs.argsort(descending=True, stable=True)
    keep = torch.zeros_like(probs, dtype=torch.bool)
    k = top_k if top_k > 0 else len(probs)
    kept_mass = probs[order[:k]].sum()
    mass = 0.0
    for token in order[:k].tolist():
        keep[token] = True
        mass += probs[token].item() / kept_mass.item()
        if mass >= top_p:
            break
    truncated = torch.where(keep, probs, 0.0)
    return truncated / truncated.sum()


def draw_counts(sampler: Sampler, logits: torch.Tensor, num_draws: int, **params) -> torch.Tensor:
    """Counts per token over `num_draws` unseeded rows with the same logits (one call)."""
    requests = [make_request(i, **params) for i in range(num_draws)]
    out = sampler(logits.expand(num_draws, -1), requests)
    return torch.bincount(torch.tensor(out.token_ids), minlength=logits.shape[-1])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_is_argmax_of_raw_logits(dtype, device):
    logits = random_logits(8).to(dtype=dtype, device=device)
    out = Sampler()(logits, [make_request(i, temperature=0.0) for i in range(8)])
    assert out.token_ids == logits.float().argmax(-1).tolist()
    assert out.logprobs == [None] * 8


def test_greedy_ties_take_lowest_id():
    logits = torch.zeros(1, VOCAB)
    logits[0, [5, 9, 40]] = 1.0
    assert Sampler()(logits, [make_request(0, temperature=0.0)]).token_ids == [5]


@pytest.mark.parametrize("temperature", [0.1, 1.0, 5.0, 100.0])
def test_top_k_one_is_greedy(temperature):
    logits = random_logits(16, seed=1)
    requests = [make_request(i, temperature=temperature, top_k=1) for i in range(16)]
    assert Sampler()(logits, requests).token_ids == logits.argmax(-1).tolist()


@pytest.mark.parametrize("temperature", [0.5, 1.0, 10.0])
def test_tiny_top_p_is_greedy(temperature):
    logits = random_logits(16, seed=2)
    requests = [make_request(i, temperature=temperature, top_p=1e-6) for i in range(16)]
    assert Sampler()(logits, requests).token_ids == logits.argmax(-1).tolist()


def test_mixed_batch_greedy_rows_unaffected_by_sampled_rows():
    logits = random_logits(6, seed=3)
    requests = [make_request(i, temperature=0.0 if i % 2 else 1.0) for i in range(6)]
    tokens = Sampler()(logits, requests).token_ids
    assert tokens[1::2] == logits[1::2].argmax(-1).tolist()


@pytest.mark.parametrize("device", DEVICES)
def test_same_seed_same_tokens_whatever_the_batch(device):
    """A seeded request draws the same tokens alone, in a crowd, and at any row position."""
    steps = 12
    flat = random_logits(steps, seed=4).to(device) * 0.1  # nearly uniform: many different tokens are likely
    alone, crowded = Sampler(seed=0), Sampler(seed=99)
    target_alone = make_request(0, temperature=1.0, seed=1234)
    target_crowded = make_request(0, temperature=1.0, seed=1234)
    others = [make_request(1), make_request(2, seed=5), make_request(3, temperature=0.0)]
    tokens_alone, tokens_crowded = [], []
    for step in range(steps):
        tokens_alone += alone(flat[step : step + 1], [target_alone]).token_ids
        batch = others[: step % 4] + [target_crowded] + others[step % 4 :]
        rows = [
            flat[step] if r is target_crowded else random_logits(1, seed=step)[0].to(device) for r in batch
        ]
        out = crowded(torch.stack(rows), batch)
        tokens_crowded.append(out.token_ids[batch.index(target_crowded)])
    assert tokens_alone == tokens_crowded
    assert len(set(tokens_alone)) > 1


@pytest.mark.parametrize("device", DEVICES)
def test_different_seeds_differ(device):
    logits = torch.zeros(2, VOCAB, device=device)
    sampler = Sampler()
    requests = [make_request(0, seed=1), make_request(1, seed=2)]
    draws = [sampler(logits, requests).token_ids for _ in range(50)]
    assert [a for a, _ in draws] != [b for _, b in draws]


def test_free_restarts_a_seeded_sequence():
    logits = torch.zeros(1, VOCAB)
    sampler = Sampler()
    request = make_request(0, seed=42)
    first = [sampler(logits, [request]).token_ids[0] for _ in range(10)]
    sampler.free(request.request_id)
    again = [sampler(logits, [request]).token_ids[0] for _ in range(10)]
    assert first == again


def test_sampler_seed_makes_unseeded_rows_reproducible():
    logits = torch.zeros(4, VOCAB)
    requests = [make_request(i) for i in range(4)]
    assert Sampler(seed=7)(logits, requests).token_ids == Sampler(seed=7)(logits, requests).token_ids


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "temperature, top_k, top_p",
    [
        (1.0, 0, 1.0),
        (0.5, 0, 1.0),
        (2.0, 0, 1.0),
        (1.0, 3, 1.0),
        (1.0, 0, 0.8),
        (0.7, 4, 0.9),
    ],
)
def test_empirical_distribution_matches_reference(temperature, top_k, top_p, device):
    expected = expected_distribution(SMALL_LOGITS, temperature, top_k, top_p)
    logits = SMALL_LOGITS.to(device)
    counts = draw_counts(
        Sampler(seed=11), logits, NUM_DRAWS, temperature=temperature, top_k=top_k, top_p=top_p
    )
    kept = expected > 0
    assert counts[~kept].sum() == 0, "sampled a token outside the kept set"
    expected_counts = expected[kept] * NUM_DRAWS
    chi_square = (((counts[kept] - expected_counts) ** 2) / expected_counts).sum().item()
    dof = int(kept.sum()) - 1
    # Mean plus six standard deviations of the chi-square distribution: a real bias fails by far.
    assert chi_square <= dof + 6 * math.sqrt(2 * max(dof, 1))


@pytest.mark.parametrize("top_k, top_p", [(5, 1.0), (0, 0.5), (10, 0.3), (1, 1.0), (0, 0.999)])
def test_never_samples_outside_kept_set(top_k, top_p):
    logits = random_logits(1, seed=5)[0]
    kept = expected_distribution(logits, 1.0, top_k, top_p) > 0
    counts = draw_counts(Sampler(seed=3), logits, 5_000, temperature=1.0, top_k=top_k, top_p=top_p)
    assert counts[~kept].sum() == 0
    assert counts.sum() == 5_000


@pytest.mark.parametrize(
    "scores, top_k, top_p, kept",
    [
        ([1.0, 3.0, 2.0, 0.0], 2, 1.0, [1, 2]),
        ([1.0, 3.0, 2.0, 0.0], 4, 1.0, [0, 1, 2, 3]),
        ([1.0, 3.0, 2.0, 0.0], 9, 1.0, [0, 1, 2, 3]),
        ([0.0, 0.0, 0.0, 0.0], 1, 1.0, [0]),  # ties: the lowest id ranks first
        ([0.0, 0.0, 0.0, 0.0], 4, 0.5, [0, 1]),  # 0.25 above token 1, 0.5 above token 2
        ([0.0, 0.0, 0.0, 0.0], 4, 0.51, [0, 1, 2]),
        ([0.0, 10.0, 0.0, 0.0], 4, 1e-9, [1]),  # always at least one
        ([5.0, 4.0, 3.0, 2.0], 2, 0.99, [0, 1]),  # top-p over the renormalized top-k
    ],
)
def test_apply_top_k_top_p_kept_sets(scores, top_k, top_p, kept):
    out = apply_top_k_top_p(torch.tensor([scores]), torch.tensor([top_k]), torch.tensor([top_p]))
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == kept
    assert torch.equal(out[0][kept], torch.tensor(scores)[kept])


def test_apply_top_k_top_p_is_per_row():
    scores = torch.tensor([[1.0, 3.0, 2.0, 0.0]] * 3)
    out = apply_top_k_top_p(scores, torch.tensor([1, 4, 4]), torch.tensor([1.0, 1.0, 0.01]))
    assert torch.isfinite(out).tolist() == [
        [False, True, False, False],
        [True, True, True, True],
        [False, True, False, False],
    ]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_logprobs", [0, 1, 5, 20])
@pytest.mark.parametrize("temperature", [0.0, 0.5, 2.0])
def test_logprobs_are_raw_log_softmax(num_logprobs, temperature, device):
    logits = random_logits(4, seed=6).to(dtype=torch.bfloat16, device=device)
    requests = [make_request(i, temperature=temperature, top_k=5, logprobs=num_logprobs) for i in range(4)]
    out = Sampler()(logits, requests)
    reference = torch.log_softmax(logits.float(), dim=-1)
    for row, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        assert entry.token_id == token
        assert entry.logprob == pytest.approx(reference[row, token].item(), abs=1e-6)
        assert len(entry.top) == num_logprobs
        values, ids = reference[row].topk(num_logprobs)
        assert list(entry.top.values()) == pytest.approx(values.tolist(), abs=1e-6)
        assert set(entry.top) == set(ids.tolist())
        assert list(entry.top.values()) == sorted(entry.top.values(), reverse=True)


def test_logprobs_only_for_rows_that_ask():
    requests = [make_request(0, logprobs=2), make_request(1), make_request(2, logprobs=0)]
    out = Sampler()(random_logits(3), requests)
    assert out.logprobs[1] is None
    assert len(out.logprobs[0].top) == 2 and out.logprobs[2].top == {}


@pytest.mark.parametrize(
    "num_output_tokens, min_tokens, stop_token_ids, ignore_eos, masked",
    [
        (0, 2, [], False, {EOS}),
        (1, 2, [10, 11], False, {EOS, 10, 11}),
        (2, 2, [10], False, set()),  # the third token may stop
        (0, 1, [10], True, {EOS, 10}),  # vLLM masks eos even with ignore_eos
        (0, 0, [10], False, set()),
        (0, 3, [VOCAB + 5], False, {EOS}),  # ids outside the vocabulary are ignored
    ],
)
def test_min_tokens_masks_stop_tokens(num_output_tokens, min_tokens, stop_token_ids, ignore_eos, masked):
    logits = torch.zeros(1, VOCAB)
    candidates = [EOS, 10, 11]
    logits[0, candidates] = 50.0  # stop tokens dominate unless masked
    for temperature in (0.0, 1.0):
        request = make_request(
            0,
            num_output_tokens=num_output_tokens,
            temperature=temperature,
            min_tokens=min_tokens,
            stop_token_ids=stop_token_ids,
            ignore_eos=ignore_eos,
        )
        tokens = {Sampler(seed=s)(logits, [request]).token_ids[0] for s in range(20)}
        assert tokens.isdisjoint(masked)
        allowed = set(candidates) - masked
        if allowed:
            assert tokens <= allowed


def test_rejects_mismatched_rows():
    with pytest.raises(ValueError, match="num_rows=2"):
        Sampler()(torch.zeros(3, VOCAB), [make_request(0), make_request(1)])
