"""The bf16 GPU tests' check (factories.greedy_divergences), on a tiny float32 model on the CPU: the same
sequences pass, a divergence to the runner-up token passes, one to a token far down the distribution fails,
and the printed agreement is only a diagnostic."""

from __future__ import annotations

import pytest
import torch
from factories import (
    TOP_LOGPROBS,
    assert_greedy_close,
    check_greedy_close,
    generate_greedy,
    greedy_divergences,
    make_model,
    top_logprobs,
)
from transformers import AutoModelForCausalLM

NUM_TOKENS = 12
PROMPTS = [[5, 17, 300, 42, 9], [100, 7, 7, 250, 31, 64, 2], [400, 3, 88]]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = make_model(tmp_path_factory.mktemp("greedy-close") / "model", arch="llama", seed=4)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.inference_mode()
def forced(model, prompt: list[int], tokens: list[int]):
    """`tokens` after `prompt`, with each position's top logprobs from one teacher-forced pass."""
    logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]  # [len(tokens), vocab]
    return tokens, top_logprobs(logits[:, None])


@torch.inference_mode()
def diverge_at(model, prompt: list[int], reference: list[int], at: int, rank: int):
    """The reference's first `at` tokens, then the token of the given rank there (1: the runner-up), then
    greedy again: what another implementation that diverged at `at` would produce."""
    logits = model(torch.tensor([prompt + reference[:at]])).logits[0, -1]
    chosen = int(logits.argsort(descending=True)[rank])
    head = reference[:at] + [chosen]
    rest = generate_greedy(model, prompt + head, NUM_TOKENS - len(head))
    return forced(model, prompt, head + rest)


@pytest.fixture(scope="module")
def reference(model):
    rows = [generate_greedy(model, p, NUM_TOKENS, top_k=TOP_LOGPROBS) for p in PROMPTS]
    assert all(len(tokens) == len(tops) == NUM_TOKENS for tokens, tops in rows)
    return rows


def test_generate_greedy_logprobs_are_the_teacher_forced_ones(model, reference):
    for prompt, (tokens, tops) in zip(PROMPTS, reference):
        _, again = forced(model, prompt, tokens)
        assert [list(t) for t in tops] == [list(t) for t in again]
        for step, token in zip(tops, tokens):
            assert next(iter(step)) == token  # greedy: the first (most likely) entry
            assert list(step.values()) == sorted(step.values(), reverse=True)


def test_identical_sequences_pass(model, reference, capsys):
    copies = [forced(model, p, tokens) for p, (tokens, _) in zip(PROMPTS, reference)]
    assert greedy_divergences(copies, reference) == []
    assert_greedy_close(copies, reference, "same", NUM_TOKENS)
    assert "agreement 1.000, 0/3 rows diverge, 0 outside" in capsys.readouterr().out


def test_divergence_to_the_runner_up_passes_and_later_tokens_are_not_compared(model, reference, capsys):
    got = list(reference)
    got[0] = diverge_at(model, PROMPTS[0], reference[0][0], at=2, rank=1)
    got[1] = diverge_at(model, PROMPTS[1], reference[1][0], at=0, rank=2)
    assert got[0][0][2] != reference[0][0][2] and got[1][0][0] != reference[1][0][0]
    assert greedy_divergences(got, reference) == []
    assert greedy_divergences(reference, got) == []
    assert_greedy_close(got, reference, "runner-up", NUM_TOKENS)
    out = capsys.readouterr().out
    # rows 0 and 1 keep 2 and 0 of their 12 tokens: the old measure reads (2 + 0 + 12) / 36
    assert f"agreement {14 / 36:.3f}, 2/3 rows diverge, 0 outside" in out


def test_divergence_outside_the_top_k_fails(model, reference):
    got = list(reference)
    got[2] = diverge_at(model, PROMPTS[2], reference[2][0], at=5, rank=TOP_LOGPROBS + 20)
    # the same prefix gives the same distribution at token 5, so the reference's token is in got's top-k
    # there: the failure is the other side's, and the check fails whichever side is passed first
    for failures in (greedy_divergences(got, reference), greedy_divergences(reference, got)):
        assert len(failures) == 1 and failures[0].startswith("row 2, token 5:"), failures
    with pytest.raises(AssertionError, match="row 2, token 5"):
        assert_greedy_close(got, reference, "far", NUM_TOKENS)
    # a mixture of experts' allowance: one failing row passes with allowed=1, two do not
    assert check_greedy_close(got, reference, "far", NUM_TOKENS, allowed=1) == []
    got[0] = diverge_at(model, PROMPTS[0], reference[0][0], at=1, rank=TOP_LOGPROBS + 30)
    assert len(check_greedy_close(got, reference, "far", NUM_TOKENS, allowed=1)) == 2


def test_a_row_is_compared_only_up_to_its_first_divergence():
    """Hand-made rows: past the first difference anything goes, and the check is symmetric."""
    top = {1: -0.1, 2: -0.2, 3: -3.0, 4: -4.0, 5: -5.0}
    far = {9: -0.1, 8: -0.2, 7: -3.0, 6: -4.0, 10: -5.0}
    reference = [([1, 1, 1], [top, top, top])]
    assert greedy_divergences([([2, 9, 9], [top, far, far])], reference) == []  # 2 is 1's runner-up
    assert len(greedy_divergences([([1, 9, 9], [top, far, far])], reference)) == 1  # 9 not in 1's top-5
    assert len(greedy_divergences(reference, [([1, 9, 9], [top, far, far])])) == 1
    with pytest.raises(ValueError):  # rows must pair up
        greedy_divergences(reference * 2, reference)
